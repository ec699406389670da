{{/* Pod-level settings shared by the head and the workers. */}}
{{- define "via-sd.podCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
{{- end }}

{{/* Container settings shared by ray-head and ray-worker: env, mounts, probes, securityContext. */}}
{{- define "via-sd.containerCommon" -}}
{{- $root := .root }}
{{- $node := .node }}
{{- $v := $root.Values }}
securityContext:
  {{- toYaml $v.containerSecurityContext | nindent 2 }}
env:
  - name: RAY_USAGE_STATS_ENABLED
    value: "0"
  {{- with $v.cacheDir }}
  - name: VIASD_CACHE_DIR
    value: {{ . | quote }}
  {{- end }}
  {{- with $v.auth.tokenSecret.name }}
  # the API token: referenced from a Secret, never written into the chart or the serve config
  - name: VIASD_API_TOKEN
    valueFrom:
      secretKeyRef:
        name: {{ . }}
        key: {{ $v.auth.tokenSecret.key }}
  {{- end }}
  {{- with $v.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
volumeMounts:
  - {name: probe, mountPath: /etc/viasd/probe, readOnly: true}
  - {name: ray-logs, mountPath: /tmp/ray}
  {{- with $v.cacheDir }}
  - {name: cache, mountPath: {{ . }}}
  {{- end }}
  {{- if eq $node "worker" }}
  - {name: dshm, mountPath: /dev/shm}
  {{- if ne $v.modelStorage.type "none" }}
  - {name: models, mountPath: {{ $v.modelStorage.mountPath }}, readOnly: {{ eq $v.modelStorage.type "pvc" }}}
  {{- end }}
  {{- end }}
  {{- if $v.mask.artifact }}
  - {name: mask, mountPath: /etc/viasd/mask, readOnly: true}
  {{- end }}
  {{- if $v.tls.secretName }}
  - {name: tls, mountPath: /etc/viasd/tls, readOnly: true}
  {{- end }}
  {{- if $v.internalTLS.secretName }}
  - {name: internal-tls, mountPath: /etc/viasd/internal-tls, readOnly: true}
  {{- end }}
{{- $probeArgs := list "--node" $node }}
{{- $ready := "live" }}
{{- if eq $node "worker" }}
{{- $ready = "ready" }}
{{- $grpc := ternary (include "via-sd.grpcPort" $root) "0" (eq (include "via-sd.grpcEnabled" $root) "true") }}
{{- $probeArgs = concat $probeArgs (list "--http-port" (include "via-sd.httpPort" $root) "--grpc-port" $grpc "--route" (include "via-sd.routePrefix" $root) "--app" ($v.serve.app_name | default "viasd")) }}
{{- end }}
# before the pod stops: drain the replicas (the whole cluster from the head, which ends it; this
# node's from a worker): new requests refused, running ones finished or ended with `abort`
lifecycle:
  preStop:
    exec:
      command: {{ concat (list "python" "-m" "viasd.cli" "drain" "--timeout-s" (include "via-sd.drainTimeout" $root)) (ternary (list "--this-node") (list) (eq $node "worker")) | toJson }}
livenessProbe:
  exec:
    command: ["python", "/etc/viasd/probe/probe.py", "live", "--node", {{ $node | quote }}]
  {{- toYaml $v.probes.liveness | nindent 2 }}
readinessProbe:
  exec:
    command: {{ concat (list "python" "/etc/viasd/probe/probe.py" $ready) $probeArgs | toJson }}
  {{- toYaml $v.probes.readiness | nindent 2 }}
{{- end }}

{{/* Volumes of a Ray pod. */}}
{{- define "via-sd.volumes" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $fullname := include "via-sd.fullname" $root }}
- name: probe
  configMap:
    name: {{ $fullname }}-probe
- name: ray-logs
  emptyDir: {}
{{- if $v.cacheDir }}
- name: cache
  emptyDir: {}
{{- end }}
{{- if eq .node "worker" }}
# shared memory for NCCL between the verifier ranks and for Ray's object store
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ $v.worker.shmSize }}
{{- if eq $v.modelStorage.type "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $v.modelStorage.pvc.existingClaim | default (printf "%s-models" $fullname) }}
    readOnly: true
{{- else if eq $v.modelStorage.type "objectStore" }}
- name: models
  emptyDir:
    sizeLimit: {{ $v.modelStorage.objectStore.sizeLimit }}
{{- end }}
{{- end }}
{{- if $v.mask.artifact }}
- name: mask
  configMap:
    name: {{ $fullname }}-mask
{{- end }}
{{- if $v.tls.secretName }}
- name: tls
  secret:
    secretName: {{ $v.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if $v.internalTLS.secretName }}
- name: internal-tls
  secret:
    secretName: {{ $v.internalTLS.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{/* The init step that copies the weights from object storage into the pod (modelStorage.type objectStore). */}}
{{- define "via-sd.initContainers" -}}
{{- $v := .Values }}
{{- if eq $v.modelStorage.type "objectStore" }}
{{- $o := $v.modelStorage.objectStore }}
initContainers:
  - name: fetch-weights
    image: {{ $o.image }}
    imagePullPolicy: {{ $v.image.pullPolicy }}
    command: {{ toJson $o.command }}
    env:
      - name: MODEL_URI
        value: {{ $o.uri | quote }}
      - name: MODEL_DIR
        value: {{ $v.modelStorage.mountPath | quote }}
    {{- with $o.credentialsSecret }}
    # object storage credentials: every key of this Secret as an environment variable
    envFrom:
      - secretRef:
          name: {{ . }}
    {{- end }}
    securityContext:
      {{- toYaml $v.containerSecurityContext | nindent 6 }}
    {{- with $o.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - {name: models, mountPath: {{ $v.modelStorage.mountPath }}}
{{- end }}
{{- end }}
