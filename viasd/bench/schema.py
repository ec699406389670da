"""JSON Schema of results.json (draft 2020-12). Tests validate every result file against it."""

from __future__ import annotations

_num = {"type": "number"}
_num_or_null = {"type": ["number", "null"]}
_spread = {
    "type": ["object", "null"],
    "required": ["median", "min", "max", "n"],
    "properties": {"median": _num, "min": _num, "max": _num, "n": {"type": "integer", "minimum": 1}},
}
_per_model_int = {
    "type": "object",
    "required": ["drafter", "slim", "full"],
    "additionalProperties": {"type": "integer", "minimum": 0},
}
_per_model_num = {"type": "object", "required": ["drafter", "slim", "full"], "additionalProperties": _num}

RUN = {
    "type": "object",
    "required": ["method", "prompt", "prompt_index", "seed", "repeat", "temperature", "ok", "error"],
    "properties": {
        "method": {"type": "string"},
        "prompt": {"type": "string"},
        "prompt_index": {"type": "integer", "minimum": 0},
        "seed": {"type": "integer"},
        "repeat": {"type": "integer", "minimum": 0},
        "temperature": _num,
        "ok": {"type": "boolean"},
        "error": {"type": ["string", "null"]},
        "traceback": {"type": "string"},
        "prompt_tokens": {"type": "integer", "minimum": 1},
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "text": {"type": ["string", "null"]},
        "generated_tokens": {"type": "integer", "minimum": 0},
        "seconds": {"type": "number", "minimum": 0},
        "tokens_per_second": _num_or_null,
        "time_to_first_token": _num_or_null,
        "rss_start_bytes": {"type": "integer", "minimum": 0},
        "peak_rss_bytes": {"type": "integer", "minimum": 0},
        "peak_rss_delta_bytes": {"type": "integer", "minimum": 0},
        "kv_bytes": {"type": ["integer", "null"], "minimum": 0},
        "stats": {"type": "object", "required": ["forwards"], "properties": {"forwards": _per_model_int}},
        "passed": {"type": "boolean"},
        "exec_result": {"type": "string"},
    },
    # a successful run carries its figures; a failed one its error
    "if": {"properties": {"ok": {"const": True}}},
    "then": {"required": ["tokens", "generated_tokens", "seconds", "tokens_per_second", "peak_rss_bytes", "stats"]},
    "else": {"required": ["traceback"], "properties": {"error": {"type": "string"}}},
}

SUMMARY = {
    "type": "object",
    "required": ["runs", "failed", "errors"],
    "properties": {
        "runs": {"type": "integer", "minimum": 0},
        "failed": {"type": "integer", "minimum": 0},
        "errors": {"type": "array", "items": {"type": "string"}},
        "tokens_per_second": _num_or_null,
        "tokens_per_second_per_pass": _spread,
        "speedup_vs_ar": _spread,
        "speedup_vs_hf": _spread,
        "time_to_first_token": _spread,
        "mean_acceptance_length": _num_or_null,
        "rejection_rate": _num_or_null,
        "tier_fractions": {
            "type": ["object", "null"],
            "required": ["accepted_by_slim", "rewritten_by_slim", "escalated_to_full"],
        },
        "forwards": _per_model_int,
        "seconds_per_model": _per_model_num,
        "peak_rss_bytes": {"type": ["integer", "null"]},
        "kv_bytes_max": {"type": ["integer", "null"]},
        "pass_at_1": {
            "type": ["object", "null"],
            "required": ["pass_at_1", "n_prompts", "n_samples", "wilson95"],
        },
        "agreement_with_ar": {"type": ["object", "null"], "required": ["prefix_share", "exact", "n"]},
        "alias_of": {"type": "string"},
    },
}

METHOD = {
    "type": "object",
    "required": ["label", "kind", "mode", "params", "alias_of", "matched_baseline", "role"],
    "properties": {
        "label": {"type": "string"},
        "kind": {"enum": ["engine", "hf_generate", "hf_assisted", "hf_lookup"]},
        "mode": {"enum": ["ar", "sd", "via", "auto"]},
        "params": {"type": "object"},
        "alias_of": {"type": ["string", "null"]},
        "matched_baseline": {"type": ["string", "null"]},
        "role": {"type": ["string", "null"]},
        "mask_info": {"type": "object"},
    },
}

RESULT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "viasd bench results",
    "type": "object",
    "required": ["meta", "methods", "prompts", "runs", "groups", "summary", "targets"],
    "properties": {
        "meta": {"type": "object"},
        "methods": {"type": "array", "items": METHOD, "minItems": 1},
        "prompts": {"type": "array", "items": {"type": "object", "required": ["id", "tokens", "executable"]}},
        "runs": {"type": "array", "items": RUN},
        "groups": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "title", "plot", "methods"],
                "properties": {"plot": {"enum": ["bar", "line", "heatmap"]}},
            },
        },
        "summary": {"type": "object", "additionalProperties": SUMMARY},
        "targets": {"type": "array", "items": {"type": "object", "required": ["target", "measured", "met"]}},
    },
}

META_REQUIRED = [
    "command",
    "engine",
    "environment",
    "params",
    "prompts",
    "max_tokens",
    "temperature",
    "seeds",
    "repeats",
]
ENVIRONMENT_REQUIRED = ["python", "torch", "transformers", "viasd", "threads", "cpu", "git_commit"]
