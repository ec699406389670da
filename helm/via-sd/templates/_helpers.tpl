{{/* Chart name, truncated to a DNS label. */}}
{{- define "via-sd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name; KubeRay appends suffixes (-raycluster-xxxxx, -head-svc), so keep it short. */}}
{{- define "via-sd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "via-sd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select this release's pods (NetworkPolicy, PodDisruptionBudget, metrics Service). */}}
{{- define "via-sd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "via-sd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "via-sd.labels" -}}
helm.sh/chart: {{ include "via-sd.chart" . }}
{{ include "via-sd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "via-sd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The one pipeline this release serves (values.schema.json allows exactly one). */}}
{{- define "via-sd.pipeline" -}}
{{- toJson (first .Values.serve.pipelines) }}
{{- end }}

{{/*
GPUs of one worker pod = one whole pipeline, as Ray places its bundles: each bundle's share must fit on one
device, so floor(1 / v) verifier ranks of share v go on a device (ceil(tp_size / that) devices; a share over 1
takes that many whole devices per rank), and the drafter's share d fits in what the last rank device leaves
(1 - its ranks x v) or takes ceil(d) more devices. TP=8 at v = 0.8, d = 0.2: 8 devices, not ceil(6.6) = 7.
*/}}
{{- define "via-sd.workerGPUs" -}}
{{- $p := include "via-sd.pipeline" . | fromJson }}
{{- $tp := int (default 1 $p.tp_size) }}
{{- $v := float64 (default 0 $p.verifier_gpus_per_rank) }}
{{- $d := float64 (default 0 $p.drafter_gpus) }}
{{- $devices := 0 }}
{{- $free := 0.0 }}
{{- if gt $v 1.0 }}
{{- $devices = mul $tp (ceil $v | int) }}
{{- else if gt $v 0.0 }}
{{- $k := floor (addf (divf 1.0 $v) 0.000000001) | int }}
{{- $devices = div (add $tp (sub $k 1)) $k }}
{{- $last := sub $tp (mul (sub $devices 1) $k) }}
{{- $free = subf 1.0 (mulf $last $v) }}
{{- end }}
{{- if gt $d (addf $free 0.000000001) }}
{{- $devices = add $devices (ceil $d | int) }}
{{- end }}
{{- $devices }}
{{- end }}

{{/*
The application's args: the ServeConfig (cluster/serve_config.py) of `serve`, with what Kubernetes decides set here:
the HTTP proxy binds 0.0.0.0, the internal drafter / verifier servers advertise the pod IP (0.0.0.0) and, with
internalTLS.secretName, use the mounted certificates for mutual TLS; a mask artifact (mask.artifact, a mounted
ConfigMap) becomes the verifier's mask (its fingerprint checked on load).
*/}}
{{- define "via-sd.serveArgs" -}}
{{- $cfg := deepCopy .Values.serve }}
{{- $http := default dict $cfg.http }}
{{- $_ := set $http "host" "0.0.0.0" }}
{{- $_ := set $cfg "http" $http }}
{{- $p := include "via-sd.pipeline" . | fromJson }}
{{- if not (hasKey $p "bind_host") }}
{{- $_ := set $p "bind_host" "0.0.0.0" }}
{{- end }}
{{- if and .Values.internalTLS.secretName (not $p.internal_tls) }}
{{- $_ := set $p "internal_tls" (dict "cert_file" "/etc/viasd/internal-tls/tls.crt" "key_file" "/etc/viasd/internal-tls/tls.key" "ca_file" "/etc/viasd/internal-tls/ca.crt") }}
{{- end }}
{{- if .Values.mask.artifact }}
{{- $engine := default dict $p.engine }}
{{- $_ := set $engine "mask" "/etc/viasd/mask/mask.json" }}
{{- $_ := set $p "engine" $engine }}
{{- end }}
{{- $_ := set $cfg "pipelines" (list $p) }}
{{- toJson $cfg }}
{{- end }}

{{/* Ports of the serving config (ServeConfig defaults when unset). */}}
{{- define "via-sd.httpPort" -}}
{{- (default dict .Values.serve.http).port | default 8000 | int }}
{{- end }}
{{- define "via-sd.grpcPort" -}}
{{- (default dict .Values.serve.grpc).port | default 9000 | int }}
{{- end }}
{{- define "via-sd.grpcEnabled" -}}
{{- $g := default dict .Values.serve.grpc }}
{{- if hasKey $g "enabled" }}{{ $g.enabled }}{{ else }}true{{ end }}
{{- end }}
{{- define "via-sd.routePrefix" -}}
{{- (default dict .Values.serve.http).route_prefix | default "/" }}
{{- end }}

{{/* Autoscaling bounds (ServeConfig defaults when unset): worker pods = pipelines = Serve replicas. */}}
{{- define "via-sd.minReplicas" -}}
{{- $a := default dict .Values.serve.autoscaling }}
{{- if hasKey $a "min_replicas" }}{{ $a.min_replicas | int }}{{ else }}1{{ end }}
{{- end }}
{{- define "via-sd.maxReplicas" -}}
{{- (default dict .Values.serve.autoscaling).max_replicas | default 1 | int }}
{{- end }}
{{- define "via-sd.initialReplicas" -}}
{{- $a := default dict .Values.serve.autoscaling }}
{{- if and (hasKey $a "initial_replicas") (ne $a.initial_replicas nil) }}{{ $a.initial_replicas | int }}{{ else }}{{ include "via-sd.minReplicas" . }}{{ end }}
{{- end }}

{{/* The public Service exposes Serve's HTTP and gRPC ports: refuse to render them open to anyone
unless a token protects them (auth.tokenSecret, read as VIASD_API_TOKEN, or serve.http.token_file)
or auth.allowAnonymous says so explicitly. */}}
{{- define "via-sd.checkAuth" -}}
{{- $http := default dict .Values.serve.http }}
{{- $env := "VIASD_API_TOKEN" }}
{{- if hasKey $http "token_env" }}{{ $env = $http.token_env }}{{ end }}
{{- $ports := printf "HTTP %s" (include "via-sd.httpPort" .) }}
{{- if eq (include "via-sd.grpcEnabled" .) "true" }}{{ $ports = printf "%s and gRPC %s" $ports (include "via-sd.grpcPort" .) }}{{ end }}
{{- if and .Values.auth.tokenSecret.name (not $http.token_file) (ne $env "VIASD_API_TOKEN") }}
{{- fail (printf "serve.http.token_env: %v would not read the token of auth.tokenSecret (VIASD_API_TOKEN)" $env) }}
{{- end }}
{{- if not (or .Values.auth.tokenSecret.name $http.token_file .Values.auth.allowAnonymous) }}
{{- fail (printf "auth.tokenSecret.name: the Service exposes %s without authentication; name a Secret holding the API token, or set auth.allowAnonymous: true to serve anonymously on purpose" $ports) }}
{{- end }}
{{- end }}

{{/* Drain timeout (ServeConfig Limits.drain_timeout_s, default 30); the pod's grace period must cover
it plus the time aborted streams take to end (viasd.cluster.drain.ABORT_GRACE_S = 10) and a margin. */}}
{{- define "via-sd.drainTimeout" -}}
{{- $l := default dict .Values.serve.limits }}
{{- $t := 30 }}
{{- if hasKey $l "drain_timeout_s" }}{{ $t = $l.drain_timeout_s }}{{ end }}
{{- if lt (int .Values.terminationGracePeriodSeconds) (add (ceil $t | int) 15) }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be at least serve.limits.drain_timeout_s + 15 (%v): the preStop drain would be cut" .Values.terminationGracePeriodSeconds (add (ceil $t | int) 15)) }}
{{- end }}
{{- $t }}
{{- end }}
