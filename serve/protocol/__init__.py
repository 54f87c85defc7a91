"""What a request may say, as pydantic models: the native and OpenAI-compatible bodies (:mod:`.requests`),
vLLM's extra fields (:mod:`.vllm_fields`), the sampling fields and pydantic's errors as one 400
(:mod:`.sampling`), structured outputs (:mod:`.structured`), chat rendering and the answer's readers
(:mod:`.chat`, :mod:`.chat_output`, :mod:`.reasoning`, :mod:`.tool_parser`, :mod:`.tool_constraint`), the
error shape and strict JSON (:mod:`.wire`). Pure: no engine state, no I/O."""
