{{/* Labels on every object: manifests/base's part-of, plus Helm's own (the test comparing the chart with the
     kustomize base ignores only these four). Names are fixed, as in the base: agents' NetworkPolicies admit the
     operator's pods by their app.kubernetes.io/name label, and one cluster has one cluster-scoped operator. */}}
{{- define "kvfleet.labels" -}}
app.kubernetes.io/part-of: kvfleet
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{- define "kvfleet.tag" -}}
{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "kvfleet.checkScope" -}}
{{- if not (has .Values.scope (list "cluster" "namespace")) }}
{{- fail (printf "scope must be cluster or namespace, not %q" .Values.scope) }}
{{- end }}
{{- if and (eq .Values.scope "namespace") (gt (int .Values.replicas) 1) }}
{{- fail "scope namespace runs one replica: kopf's peering, which keeps one active, is cluster-wide only" }}
{{- end }}
{{- end }}

{{/* The rules both scopes grant, in the order and words of manifests/base/cluster.yaml, where each is explained
     (tests/operator/test_manifests.py keeps them in step with the calls kube.py makes). */}}
{{- define "kvfleet.rules" -}}
- apiGroups: [serving.kvfleet.dev]
  resources: [inferencedeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.kvfleet.dev]
  resources: [inferencedeployments/status]
  verbs: [patch]
- apiGroups: [serving.kvfleet.dev]
  resources: [inferencedeployments/finalizers]
  verbs: [update]
- apiGroups: [serving.kvfleet.dev]
  resources: [inferencerouters]
  verbs: [get, list, watch, patch]
- apiGroups: [serving.kvfleet.dev]
  resources: [inferencerouters/status]
  verbs: [patch]
- apiGroups: [serving.kvfleet.dev]
  resources: [inferencerouters/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, create, patch]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end }}

{{/* What only a cluster-wide operator needs: kopf's cluster-wide peering (create: the operator makes its
     ClusterKopfPeering), and noticing CRDs and namespaces come and go. */}}
{{- define "kvfleet.clusterRules" -}}
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [list, watch, create, patch]
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end }}
