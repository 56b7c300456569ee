"""Text generation in ``kiln serve``: a thread stepping the engine core (loop_driver.py; the scheduling
itself is generation/core.py), the served model (model.py: a ``served.ServedModel``), request parameters
(generation/request/params.py), and the protocol edges: OpenAI (openai_routes.py; the Responses API in responses_routes.py,
translated to and from the chat route's request by responses_request.py and responses_output.py),
Triton's generate extension (generate_routes.py), OIP infer and gRPC streaming (oip.py, called by the
model)."""
