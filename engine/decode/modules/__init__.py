"""The model's modules as the native decode paths (engine.decode.paths) see them: which families and
experts modules the kernels compute (`families`, `expert_recipe`), the attention the native steps
run for one query (`one_query_attention`, `latent_attention`), the switch patched modules read
(`switch`), the model's modules switched onto the native kernels (`native_modules`), the experts
kernels handed to the expert cache (`native_experts`), and the whole-token step with what it
recognises (`whole_token_step`). None of these is a path itself."""
