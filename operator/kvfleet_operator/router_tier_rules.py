"""CEL rules of an InferenceRouter's spec.tieredModels, each with the message users see (pydantic raises the same)."""

from __future__ import annotations

from kvfleet_operator.rules import Rule

# The router's own limits and defaults (kvfleet_router/tier_config.py), declared again: the operator imports nothing
# of the router. tests/operator/test_router_tier_models.py checks that both agree.
UNMATCHED = "unmatched"  # the class of a request no configured class matches: served by the top tier
CLASS_NAME_PATTERN = "^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$"
DEFAULT_MARKERS = ("```", "def ", "class ", "function", "step by step", "prove", "explain why", "reason",
                   "analyze", "analyse", "derive")
MIN_TIERS, MAX_TIERS = 2, 8
COST_MAX = 1e9
MODEL_TIMEOUT_MIN, MODEL_TIMEOUT_MAX = 0.01, 60.0
WINDOW_MIN, WINDOW_MAX = 1.0, 86400.0
MIN_SAMPLES_MAX, MAX_CONCURRENT_MAX, MAX_PER_MINUTE_MAX = 100000, 64, 100000
# The operator's own bounds (the router has none): the apiserver estimates each CEL rule's cost from them.
MAX_TIERED_MODELS, MAX_CLASSES, MAX_MARKERS, MAX_MARKER_LENGTH, MAX_NAME_LENGTH = 32, 16, 64, 64, 128

_TM = "spec.tieredModels[]"

TIERED_NAME_RULE = Rule("size(self) > 0", f"{_TM}.name must not be empty: give the model name clients send")
TIERED_NAMES_UNIQUE_RULE = Rule("self.all(a, self.exists_one(b, b.name == a.name))",
                                "spec.tieredModels names a model twice: keep one entry per model name")
TIERS_COUNT_RULE = Rule(f"size(self) >= {MIN_TIERS} && size(self) <= {MAX_TIERS}",
                        f"{_TM}.tiers must list {MIN_TIERS} to {MAX_TIERS} served models, cheapest first: add a tier "
                        "(a tiered model of one tier is just that model) or remove some")
TIER_MODEL_RULE = Rule("size(self) > 0", f"{_TM}.tiers[].model must not be empty: give the model name an "
                                         "InferenceDeployment serves (its spec.model.name)")
TIER_COST_RULE = Rule("self >= 0.0 && self <= 1000000000.0",
                      f"{_TM}.tiers[].cost is a relative cost per request and must be between 0 and 1e9: e.g. 1 for "
                      "the cheapest tier and 10 for one ten times as dear")
TIERS_DISTINCT_RULE = Rule("self.tiers.all(a, self.tiers.exists_one(b, b.model == a.model)) && "
                           "!self.tiers.exists(t, t.model == self.name)",
                           f"{_TM}.tiers: every tier must be another served model, and none may be the tiered "
                           "model's own name: list each served model once", ".tiers")
CLASS_TIER_RULE = Rule("self.classifier.classes.all(c, c.tier >= 0 && c.tier < size(self.tiers))",
                       f"{_TM}.classifier.classes[].tier must index the tiers (0 the cheapest, up to the number of "
                       "tiers - 1): fix the class's tier, or add the tier it names", ".classifier.classes")
CLASS_NAME_RULE = Rule(f"self.matches('{CLASS_NAME_PATTERN}') && self != '{UNMATCHED}'",
                       f"{_TM}.classifier.classes[].name must be lowercase letters, digits and '-' (at most 32, "
                       f"starting and ending with a letter or digit) and not '{UNMATCHED}' (the class of requests no "
                       "class matches): rename the class")
CLASSES_SIZE_RULE = Rule("size(self) > 0", f"{_TM}.classifier.classes is empty: give at least one class, or leave "
                                           "classes out for the default")
CLASSES_UNIQUE_RULE = Rule("self.all(a, self.exists_one(b, b.name == a.name))",
                           f"{_TM}.classifier.classes names a class twice: give each class its own name")
MAX_PROMPT_TOKENS_RULE = Rule("self >= 0", f"{_TM}.classifier.classes[].maxPromptTokens must be >= 0: give the "
                                           "limit, or leave it out for no limit")
MAX_OUTPUT_TOKENS_RULE = Rule("self >= 0", f"{_TM}.classifier.classes[].maxOutputTokens must be >= 0: give the "
                                           "limit, or leave it out for no limit")
MAX_TURNS_RULE = Rule("self >= 0", f"{_TM}.classifier.classes[].maxTurns must be >= 0: give the limit, or leave it "
                                   "out for no limit")
MARKERS_RULE = Rule("self.all(m, size(m) > 0)", f"{_TM}.classifier.markers must be non-empty strings (matched "
                                                "case-insensitively): remove the empty entry")
MODEL_TIMEOUT_RULE = Rule(f"self >= {MODEL_TIMEOUT_MIN} && self <= {MODEL_TIMEOUT_MAX}",
                          f"{_TM}.classifier.modelTimeoutSeconds must be between {MODEL_TIMEOUT_MIN:g} and "
                          f"{MODEL_TIMEOUT_MAX:g}: the classifier model's answer is awaited this long, e.g. 1")
SAMPLE_RATE_RULE = Rule("self >= 0.0 && self <= 1.0",
                        f"{_TM}.quality.sampleRate is the share of lower-tier answers replayed on the top tier and "
                        "must be between 0 and 1: e.g. 0.05")
THRESHOLD_RULE = Rule("self >= 0.0 && self <= 1.0",
                      f"{_TM}.quality.threshold must be between 0 and 1 (agreement is a score in [0, 1]): e.g. 0.5")
HYSTERESIS_RULE = Rule("self >= 0.0 && self <= 1.0",
                       f"{_TM}.quality.hysteresis must be between 0 and 1 (agreement is a score in [0, 1]): e.g. 0.1")
# As the router checks it (hysteresis <= 1 - threshold, in doubles), so that both refuse the same values.
HYSTERESIS_SUM_RULE = Rule("self.threshold + self.hysteresis <= 1.0",
                           f"{_TM}.quality: threshold + hysteresis is the score a demotion needs and must be at most "
                           "1: lower hysteresis or threshold", ".hysteresis")
WINDOW_RULE = Rule(f"self >= {WINDOW_MIN} && self <= {WINDOW_MAX}",
                   f"{_TM}.quality.windowSeconds must be between {WINDOW_MIN:g} and {WINDOW_MAX:g}: e.g. 300")
MIN_SAMPLES_RULE = Rule(f"self >= 1 && self <= {MIN_SAMPLES_MAX}",
                        f"{_TM}.quality.minSamples must be between 1 and {MIN_SAMPLES_MAX} (a window with fewer "
                        "scores decides nothing): e.g. 20")
MAX_CONCURRENT_RULE = Rule(f"self >= 1 && self <= {MAX_CONCURRENT_MAX}",
                           f"{_TM}.quality.maxConcurrentReplays must be between 1 and {MAX_CONCURRENT_MAX}: e.g. 2")
MAX_PER_MINUTE_RULE = Rule(f"self >= 1 && self <= {MAX_PER_MINUTE_MAX}",
                           f"{_TM}.quality.maxReplaysPerMinute must be between 1 and {MAX_PER_MINUTE_MAX}: e.g. 60")
