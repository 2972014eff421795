"""LoRA adapters on a base model (issue 31): checkpoint.py reads and checks
PEFT's files; the layers that run them come next."""
