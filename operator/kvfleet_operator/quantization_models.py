"""spec.runtime.quantization and kvCacheDtype: their names, what this agent image runs of them, and their CEL rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from kvfleet_operator.rules import Rule, cel

# vLLM's spellings. int8 and int4 quantize an fp checkpoint's weights as it loads; the others name a pre-quantized
# checkpoint's own format, which the agent otherwise reads from its config.json (quantization_config).
Quantization = Literal["int8", "int4", "gptq", "awq", "compressed-tensors", "fp8"]
KvCacheDtype = Literal["auto", "int8", "fp8", "fp8_e4m3"]  # fp8 is E4M3, as in vLLM
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDtype)

# What this agent image runs (kvfleet_agent's --quantization and --kv-cache-dtype), declared again: the operator
# imports nothing of the agent. A name the CRD knows but the image does not run is refused at admission; when the
# agent gains one, add it here and regenerate the CRD (python -m kvfleet_operator.crd).
SUPPORTED_QUANTIZATIONS: tuple[str, ...] = QUANTIZATIONS
SUPPORTED_KV_CACHE_DTYPES: tuple[str, ...] = KV_CACHE_DTYPES


def _cel_string(text: str) -> str:
    """`text` as a double-quoted CEL string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True)
class Support:
    """The names one spec.runtime field may hold (the CRD's enum) and those this agent image runs."""

    field: str  # its camelCase name under spec.runtime
    known: tuple[str, ...]
    supported: tuple[str, ...]

    def message(self, value: str) -> str:
        """Why `value` is refused, and what to change."""
        return f"spec.runtime.{self.field} '{value}' is not supported by this agent image {self._fix()}"

    def _fix(self) -> str:
        return (f"(kvfleet agent supports: {', '.join(self.supported)}); remove the field or set it to "
                f"{' or '.join(self.supported)}")

    @property
    def rule(self) -> Rule | None:
        """The CEL rule on the field (messageExpression names the value), or None when the image runs every name."""
        unsupported = [n for n in self.known if n not in self.supported]
        if not unsupported:
            return None
        head, tail = self.message("\0").split("\0")
        return Rule(f"self in [{', '.join(repr(n) for n in self.supported)}]",
                    f"spec.runtime.{self.field} {' and '.join(unsupported)} are not supported by this agent image "
                    f"{self._fix()}",
                    message_expression=f"{_cel_string(head)} + self + {_cel_string(tail)}")

    def schema(self) -> dict[str, Any] | None:
        """The field's json_schema_extra: its rule, if any."""
        return cel(self.rule) if self.rule is not None else None

    def check(self, value: str | None) -> None:
        """Raise the rule's message (pydantic reports it) when the image does not run `value`."""
        if value is not None and value not in self.supported:
            raise ValueError(self.message(value))


QUANTIZATION = Support("quantization", QUANTIZATIONS, SUPPORTED_QUANTIZATIONS)
KV_CACHE_DTYPE = Support("kvCacheDtype", KV_CACHE_DTYPES, SUPPORTED_KV_CACHE_DTYPES)
# On RuntimeSpec, which sees both fields: FP8 kernels take and give bfloat16 or float16 activations, never float32.
FP8_DTYPE_RULE = Rule("!has(self.quantization) || self.quantization != 'fp8' || !has(self.dtype) || "
                      "self.dtype != 'float32'",
                      "spec.runtime.quantization fp8 cannot run with spec.runtime.dtype float32 (FP8 weights compute "
                      "in bfloat16 or float16): set dtype to bfloat16 or float16, or leave it auto", ".dtype")
RULES = tuple(r for r in (QUANTIZATION.rule, KV_CACHE_DTYPE.rule, FP8_DTYPE_RULE) if r is not None)


def check_quantization(quantization: str | None, kv_cache_dtype: str | None, dtype: str) -> None:
    """The pydantic side of RULES: the same refusals, with the same messages."""
    QUANTIZATION.check(quantization)
    KV_CACHE_DTYPE.check(kv_cache_dtype)
    if quantization == "fp8" and dtype == "float32":
        raise ValueError(FP8_DTYPE_RULE.message)

