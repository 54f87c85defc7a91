"""Model directories for the lab: synthesize, download, validate, resolve and fingerprint.

Everything here works on plain Hugging Face Qwen3 model directories (``config.json``,
``*.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``): ``files`` holds ModelError and the
file helpers, ``tokenizer`` the qwen.tiktoken conversion, ``synth`` seeded synthetic models,
``identity`` validation and fingerprints, ``download`` the hub download and ``resolve`` the choice
``--model`` > ``$MODEL_DIR`` > embedded default. User-caused problems raise ModelError (one line).
"""
