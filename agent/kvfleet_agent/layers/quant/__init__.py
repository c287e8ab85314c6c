"""Weight quantization: the canonical quantized weight, on-load quantizers, checkpoint formats and backends."""
