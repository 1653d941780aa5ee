"""The audit's stages on a prepared context: the leakage measurement (dFIL, prior, bounds), utility, the
up-front cost estimate, calibration and the token statement (the verdicts on their result are in
splitaudit.verdicts)."""
