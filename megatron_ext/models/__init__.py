"""The model's one description: families (``families.py``) and what is derived from them, its
FLOPs (``flops.py``) among them."""
