"""LoRA adapters: reading PEFT's format (``adapter``) and applying many adapters inside one
ragged batch (``layers``)."""
