"""Weight formats: GGUF block layouts (Q8_0, Q6_K, Q4_K, Q3_K, Q2_K), quantizing and dequantizing them."""
