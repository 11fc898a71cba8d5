{{- define "kvroute.labels" -}}
app.kubernetes.io/name: kvroute
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{- /* The name of an object that releases of the same name in other namespaces could also write:
cluster-scoped ones, and those in policy.namespace when it is not the release's. Such names carry the
release's namespace, so two releases called kvroute in two namespaces install side by side.
Called with (list $ suffix) for policy.namespace, (list $ suffix true) for the cluster. */}}
{{- define "kvroute.sharedName" -}}
{{- $ := index . 0 -}}
{{- $cluster := gt (len .) 2 -}}
{{- if or $cluster (ne $.Values.policy.namespace $.Release.Namespace) -}}
{{ $.Release.Name }}-{{ $.Release.Namespace }}-{{ index . 1 }}
{{- else -}}
{{ $.Release.Name }}-{{ index . 1 }}
{{- end -}}
{{- end }}

{{- /* The replica store: the one this release deploys, or the one the values name. */}}
{{- define "kvroute.replicaStoreURL" -}}
{{- $store := .Values.extproc.replicaStore -}}
{{- if $store.deploy -}}
redis://{{ .Release.Name }}-replica-store.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:6379/0
{{- else if $store.url -}}
{{ $store.url }}
{{- else -}}
{{ fail "extproc.replicas > 1 needs extproc.replicaStore.deploy or extproc.replicaStore.url" }}
{{- end -}}
{{- end }}

{{- define "kvroute.replicaStoreSecret" -}}
{{- if .Values.extproc.replicaStore.deploy -}}
{{ .Release.Name }}-replica-store
{{- else -}}
{{ required "extproc.replicaStore.passwordSecret: a Secret with key `password`" .Values.extproc.replicaStore.passwordSecret }}
{{- end -}}
{{- end }}

{{- /* The InferencePool kvroute picks for, after checking the values that go with picker mode. */}}
{{- define "kvroute.poolName" -}}
{{- $pool := .Values.inferencePool -}}
{{- if .Values.envoy.enabled -}}
{{ fail "inferencePool.enabled: the gateway's Envoy calls kvroute; set envoy.enabled: false" }}
{{- end -}}
{{- if ne .Values.policy.namespace .Release.Namespace -}}
{{ fail (printf "inferencePool.enabled: the pool, its picker Service and the policy share a namespace; set policy.namespace to %s" .Release.Namespace) }}
{{- end -}}
{{- if and (not $pool.create) (not $pool.name) -}}
{{ fail "inferencePool.create: false needs inferencePool.name (an existing pool)" }}
{{- end -}}
{{- $pool.name | default .Release.Name -}}
{{- end }}

{{- /* Mutual TLS between this release's Envoy and the ext_proc: on with its own Envoy only. */}}
{{- define "kvroute.mtls" -}}
{{- if and .Values.envoy.enabled .Values.extproc.mtls.enabled }}true{{ end -}}
{{- end }}

{{- /* The Secrets of the stream token and of each side's TLS: given, else the chart's own. */}}
{{- define "kvroute.grpcTokenSecret" -}}
{{- .Values.envoy.grpcTokenSecret | default (printf "%s-grpc-token" .Release.Name) -}}
{{- end }}

{{- define "kvroute.tlsSecretsGiven" -}}
{{- $mtls := .Values.extproc.mtls -}}
{{- if ne (empty $mtls.extprocSecret) (empty $mtls.envoySecret) -}}
{{ fail "extproc.mtls.extprocSecret and extproc.mtls.envoySecret go together (one CA signs both)" }}
{{- end -}}
{{- if $mtls.extprocSecret }}true{{ end -}}
{{- end }}

{{- define "kvroute.extprocTlsSecret" -}}
{{- .Values.extproc.mtls.extprocSecret | default (printf "%s-extproc-tls" .Release.Name) -}}
{{- end }}

{{- define "kvroute.envoyTlsSecret" -}}
{{- .Values.extproc.mtls.envoySecret | default (printf "%s-envoy-tls" .Release.Name) -}}
{{- end }}

{{- /* The ext_proc's gRPC port in its Services: TLS as a picker or with mutual TLS, else h2c. */}}
{{- define "kvroute.grpcServicePort" -}}
{{- if or .Values.inferencePool.enabled (include "kvroute.mtls" .) -}}
- {name: grpc, port: 9002, targetPort: grpc}
{{- else -}}
- {name: grpc, port: 9002, targetPort: grpc, appProtocol: kubernetes.io/h2c}
{{- end -}}
{{- end }}

{{- /* How this release's Envoy asks kvroute (envoy.transport); a disaggregated policy needs ext_proc. */}}
{{- define "kvroute.transport" -}}
{{- $transport := .Values.envoy.transport -}}
{{- if not (has $transport (list "ext_authz" "ext_proc")) -}}
{{ fail (printf "envoy.transport is ext_authz or ext_proc, not %q" $transport) }}
{{- end -}}
{{- range prepend (.Values.policy.extra | default list) (dict "field" "policy.role" "role" .Values.policy.role) -}}
{{- if and (has (.role | default "") (list "prefill" "decode")) (eq $transport "ext_authz") -}}
{{ fail (printf "%s makes a disaggregated fleet: set envoy.transport: ext_proc (the ext_authz transport cannot hand a prefill over)" (.field | default (printf "policy.extra %s's role" .name))) }}
{{- end -}}
{{- end -}}
{{- $transport -}}
{{- end }}

{{- /* The ext_proc serves this release's Envoy on its ext_authz port. */}}
{{- define "kvroute.authz" -}}
{{- if and .Values.envoy.enabled (eq (include "kvroute.transport" .) "ext_authz") }}true{{ end -}}
{{- end }}

{{- /* Every policy the ext_proc follows, NAMESPACE/NAME comma-separated: the chart's, then policy.extra. */}}
{{- define "kvroute.policies" -}}
{{- $namespace := .Values.policy.namespace -}}
{{- $names := list (printf "%s/%s" $namespace .Values.policy.name) -}}
{{- range .Values.policy.extra -}}
{{- if $.Values.inferencePool.enabled -}}
{{ fail "policy.extra: a gateway asks one picker per InferencePool; deploy one release per pool" }}
{{- end -}}
{{- $name := printf "%s/%s" $namespace (required "policy.extra[].name" .name) -}}
{{- if has $name $names -}}
{{ fail (printf "policy.extra: %s is named twice" $name) }}
{{- end -}}
{{- $names = append $names $name -}}
{{- end -}}
{{- join "," $names -}}
{{- end }}

{{- /* Envoy's wait for each ext_proc reply, in ms: message_timeout_ms (extproc/envoy/bootstrap.py)
for the longest queueTTLSeconds and prefillTimeoutSeconds among the policies the chart writes, so
that a policy holding requests longer still answers each itself (tests/test_chart.py checks the two
agree). */}}
{{- define "kvroute.messageTimeoutMs" -}}
{{- $ttl := 30.0 -}}
{{- $prefill := 30.0 -}}
{{- range (prepend (.Values.policy.extra | default list) (dict "routing" .Values.policy.routing)) -}}
{{- $routing := .routing | default dict -}}
{{- $ttl = maxf $ttl (index $routing "queueTTLSeconds" | default 0) -}}
{{- $prefill = maxf $prefill (index $routing "prefillTimeoutSeconds" | default 0) -}}
{{- end -}}
{{- mulf (addf $ttl 10 $prefill 5) 1000 | int -}}
{{- end }}

{{- /* Where a part's pods run and what they carry, from the part's values (nodeSelector,
tolerations, affinity, priorityClassName) and image.pullSecrets: the router kept on CPU nodes of
a GPU cluster, images from a private registry. Called with (list $ .Values.PART); empty values
render nothing. */}}
{{- define "kvroute.podPlacement" -}}
{{- $root := index . 0 -}}
{{- $part := index . 1 -}}
{{- with $root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- range . }}
  - name: {{ . | quote }}
  {{- end }}
{{- end }}
{{- with $part.priorityClassName }}
priorityClassName: {{ . | quote }}
{{- end }}
{{- with $part.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $part.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $part.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- /* kvroute's image: the tag defaults to the chart's appVersion (an empty tag rendered `repo:`). */}}
{{- define "kvroute.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/*
The request headers the ext_proc reads beyond the defaults: every policy's sessionHeaders and
tenantHeader (Envoy sends a check or a stream only the headers it is told to), and
envoy.forwardHeaders (an existing policy's, which the chart cannot read). Comma-separated, lower case.
*/}}
{{- define "kvroute.forwardHeaders" -}}
{{- $headers := list -}}
{{- range prepend (.Values.policy.extra | default list) (dict "routing" .Values.policy.routing) -}}
{{- $routing := .routing | default dict -}}
{{- range ($routing.sessionHeaders | default list) -}}
{{- $headers = append $headers (lower .) -}}
{{- end -}}
{{- with $routing.tenantHeader -}}
{{- $headers = append $headers (lower .) -}}
{{- end -}}
{{- end -}}
{{- range (.Values.envoy.forwardHeaders | default list) -}}
{{- $headers = append $headers (lower .) -}}
{{- end -}}
{{- $headers | uniq | join "," -}}
{{- end }}
