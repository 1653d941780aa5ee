"""What the attacks are built from, beside the attacks themselves (attacks/*.py, one module each):
networks and decoders, reconstruction and text metrics, SDAR's training loop, the relaxation of token
inversion, feature reductions and the naming of clusters."""
