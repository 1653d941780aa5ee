"""The model formats, one module each: a ModelLoader subclass (audit/inputs/model_format.py) named by
its line in core/registries.py MODEL_FORMATS."""
