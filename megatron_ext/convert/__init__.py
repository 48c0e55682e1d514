"""Converting checkpoints to and from other libraries: Hugging Face transformers (``hf.py``), the
library behind ``tools/convert_checkpoint.py``."""
