"""TensorRT-LLM's interfaces translated to and from Slipstream's: the ensemble's inputs and
outputs, its metric families, batched requests' rows and the LLM-API model's interface."""
