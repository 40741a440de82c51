"""Training loops written the way public scripts write them (accelerate's nlp_example.py accumulating by hand,
nanoGPT's train.py, pytorch/examples' mnist/main.py, PEFT's LoRA causal-LM example), instrumented by the lines
docs/instrument.md documents and nothing more, each recording its own count of what it did (truth.py) for
tests/test_conformance.py to hold the record against."""
