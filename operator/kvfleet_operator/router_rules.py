"""CEL validation rules of the InferenceRouter CRD, each with the message users see (pydantic raises the same)."""

from __future__ import annotations

from kvfleet_operator.rules import NAME_RULE, Rule

# The router's name becomes its Service's and ServiceAccount's, as for an InferenceDeployment; its own labels
# select the router pods.
ROUTER_NAME_RULE = Rule(NAME_RULE.rule,
                        "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting with a "
                        "letter, at most 63 characters) because the router's Service is named after it: rename the "
                        "InferenceRouter")
ROUTER_RESERVED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
                          "serving.kvfleet.dev/client")
ROUTER_LABELS_RULE = Rule(" && ".join(f"!('{k}' in self)" for k in ROUTER_RESERVED_LABELS),
                          "spec.pod.labels must not set app.kubernetes.io/name, app.kubernetes.io/instance, "
                          "app.kubernetes.io/managed-by or serving.kvfleet.dev/client (the operator selects the "
                          "router pods by the first three, and agents admit them by the last): remove those keys")
NAMESPACE_PATTERN = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
WATCH_NAMESPACES_NAME_RULE = Rule(f"self.all(n, n.matches('{NAMESPACE_PATTERN}'))",
                                  "spec.watchNamespaces items must be namespace names (lowercase letters, digits and "
                                  "'-', starting and ending with a letter or digit): fix the misspelt name")
WATCH_NAMESPACES_UNIQUE_RULE = Rule("self.all(a, self.exists_one(b, b == a))",
                                    "spec.watchNamespaces lists a namespace twice: keep one entry for each")
EPSILON_RULE = Rule("self >= 0.0 && self <= 100.0",
                    "spec.epsilon is the bounded-load slack (a replica takes at most (1 + epsilon) x the mean load "
                    "by prefix affinity) and must be between 0 and 100: 0.25 is a good start")
SCRAPE_INTERVAL_RULE = Rule("self > 0.0 && self <= 5.0",
                            "spec.scrapeIntervalSeconds must be > 0 and <= 5 (the router balances on load it scraped "
                            "this long ago): use e.g. 0.25")
HOLD_SIZE_RULE = Rule("self >= 0 && self <= 100000",
                      "spec.holdQueue.size must be between 0 and 100000 requests held per model (0: refuse at once "
                      "with 503 when a model has no ready replica)")
HOLD_TIMEOUT_RULE = Rule("self > 0.0 && self <= 3600.0",
                         "spec.holdQueue.timeoutSeconds must be > 0 and <= 3600: give the longest a held request may "
                         "wait for a replica to become ready, e.g. 120")
