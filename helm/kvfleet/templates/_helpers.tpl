{{/*
Names and labels.
*/}}
{{- define "kvfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name; every object is "<fullname>-<component>". */}}
{{- define "kvfleet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Usage: include "kvfleet.componentName" (list $ "gateway") */}}
{{- define "kvfleet.componentName" -}}
{{- printf "%s-%s" (include "kvfleet.fullname" (index . 0)) (index . 1) }}
{{- end }}

{{/* Usage: include "kvfleet.selectorLabels" (list $ "gateway") */}}
{{- define "kvfleet.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "kvfleet.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* Usage: include "kvfleet.labels" (list $ "gateway") */}}
{{- define "kvfleet.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
app.kubernetes.io/part-of: kvfleet
{{- end }}

{{/*
Ports. Fixed inside the pods (each role's flags set them); only the gateway's
Service port is a value.
*/}}
{{- define "kvfleet.port.gateway" -}}8000{{- end }}
{{- define "kvfleet.port.worker" -}}50051{{- end }}
{{- define "kvfleet.port.scheduler" -}}50052{{- end }}
{{- define "kvfleet.port.tokenizer" -}}50053{{- end }}
{{- define "kvfleet.metricsPort.worker" -}}9091{{- end }}
{{- define "kvfleet.metricsPort.scheduler" -}}9092{{- end }}
{{- define "kvfleet.metricsPort.tokenizer" -}}9093{{- end }}

{{- define "kvfleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString .Values.image.tag) }}
{{- end }}

{{/* NATS and Redis: the bundled Services, or the URLs given in values. */}}
{{- define "kvfleet.natsUrl" -}}
{{- if .Values.nats.bundled }}
{{- printf "nats://%s:4222" (include "kvfleet.componentName" (list . "nats")) }}
{{- else }}
{{- required "nats.url is required when nats.bundled is false" .Values.nats.url }}
{{- end }}
{{- end }}

{{- define "kvfleet.redisUrl" -}}
{{- if .Values.redis.bundled }}
{{- printf "redis://%s:6379/0" (include "kvfleet.componentName" (list . "redis")) }}
{{- else }}
{{- required "redis.url is required when redis.bundled is false" .Values.redis.url }}
{{- end }}
{{- end }}

{{- define "kvfleet.clusterTokenSecretName" -}}
{{- default (include "kvfleet.componentName" (list . "cluster-token")) .Values.clusterToken.existingSecret }}
{{- end }}

{{/* The cluster token every role's gRPC server asks of its callers (and its channels
present): from the Secret, through the environment, never an argument. */}}
{{- define "kvfleet.clusterTokenEnv" -}}
- name: KVFLEET_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.clusterTokenSecretName" . }}
      key: cluster-token
{{- end }}

{{- define "kvfleet.apiKeySecretName" -}}
{{- default (include "kvfleet.componentName" (list . "api-key")) .Values.auth.existingSecret }}
{{- end }}

{{/*
Engine flags. The <fullname>-engine ConfigMap holds one variable per flag; the
scheduler and worker containers load it with envFrom and name each variable in
their args, where Kubernetes expands $(VAR). Both read one source, so they cannot
disagree. A flag's variable is KVFLEET_ plus its name in capitals
(max-model-len: KVFLEET_MAX_MODEL_LEN). A boolean's variable holds the whole flag
(--enable-prefix-caching or --no-enable-prefix-caching), as vLLM spells them.
*/}}
{{- define "kvfleet.engineVar" -}}
{{- printf "KVFLEET_%s" (. | trimPrefix "--" | upper | replace "-" "_") }}
{{- end }}

{{/* The ConfigMap's data lines for .Values.engine; null values are left out. */}}
{{- define "kvfleet.engineData" -}}
{{- range $flag, $value := .Values.engine }}
{{- $name := $flag | trimPrefix "--" }}
{{- if has $name (list "model" "served-model-name") }}
{{- fail (printf "set %s at the top level of the values, not under engine" $name) }}
{{- end }}
{{- if kindIs "bool" $value }}
{{ include "kvfleet.engineVar" $name }}: {{ ternary (printf "--%s" $name) (printf "--no-%s" $name) $value | quote }}
{{- else if not (kindIs "invalid" $value) }}
{{ include "kvfleet.engineVar" $name }}: {{ ternary $value (toJson $value) (kindIs "string" $value) | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The scheduler's and worker's args for the engine flags. */}}
{{- define "kvfleet.engineArgs" -}}
- --model=$(KVFLEET_MODEL)
{{- range $flag, $value := .Values.engine }}
{{- $name := $flag | trimPrefix "--" }}
{{- if kindIs "bool" $value }}
- $({{ include "kvfleet.engineVar" $name }})
{{- else if not (kindIs "invalid" $value) }}
- --{{ $name }}=$({{ include "kvfleet.engineVar" $name }})
{{- end }}
{{- end }}
{{- end }}

{{/* envFrom of every kvfleet container: the model and the engine flags. */}}
{{- define "kvfleet.engineEnvFrom" -}}
envFrom:
  - configMapRef:
      name: {{ include "kvfleet.modelComponentName" (list . "engine") }}
{{- end }}

{{/* Env of the containers that use no GPU. The CUDA image sets
NVIDIA_VISIBLE_DEVICES=all, with which the NVIDIA container runtime would hand such a
container every GPU of its node, past the device plugin's accounting. */}}
{{- define "kvfleet.noGpuEnv" -}}
- name: NVIDIA_VISIBLE_DEVICES
  value: void
{{- end }}

{{/*
Draining. On deletion a pod first runs its preStop hook (a sleep, while Services
and the gateway's scheduler list drop it), then gets SIGTERM: readiness fails, new
requests get 503, in-flight ones get --shutdown-timeout to finish. The grace period
covers both, plus a margin for the process to exit.
*/}}
{{- define "kvfleet.terminationGracePeriodSeconds" -}}
{{- add .Values.drain.preStopSleepSeconds .Values.drain.shutdownTimeoutSeconds 10 }}
{{- end }}

{{- define "kvfleet.preStopSleep" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", "{{ .Values.drain.preStopSleepSeconds }}"]
{{- end }}

{{/*
gRPC probes of a role (grpc.health.v1, service ""): SERVING once its model or
tokenizer is loaded, NOT_SERVING from SIGTERM on. With readinessService, readiness asks
about that service instead (a scheduler's: not ready while its worker is away or while
it drains for the planner, alive all the same). Usage:
include "kvfleet.grpcProbes" (dict "port" 50051 "startupSeconds" 600 ["readinessService" NAME])
*/}}
{{- define "kvfleet.grpcProbes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 5
  failureThreshold: {{ max 1 (div .startupSeconds 5) }}
readinessProbe:
  grpc:
    port: {{ .port }}
    {{- with .readinessService }}
    service: {{ . }}
    {{- end }}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end }}

{{/* The pod-level settings of a kvfleet pod: security, draining, and placement from
a component's values. Usage: include "kvfleet.podSettings" (list $ .Values.gateway) */}}
{{- define "kvfleet.podSettings" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ include "kvfleet.terminationGracePeriodSeconds" $root }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $component.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $component.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $component.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The model cache volume: a PVC, a node directory, or an emptyDir. */}}
{{- define "kvfleet.modelCacheVolume" -}}
- name: models
{{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
    readOnly: true
{{- else if .Values.modelCache.hostPath }}
  hostPath:
    path: {{ .Values.modelCache.hostPath }}
    type: Directory
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{- define "kvfleet.loraVolume" -}}
{{- with .Values.loraAdapters }}
{{- if .existingClaim }}
- name: lora-adapters
  persistentVolumeClaim:
    claimName: {{ .existingClaim }}
    readOnly: true
{{- else if .hostPath }}
- name: lora-adapters
  hostPath:
    path: {{ .hostPath }}
    type: Directory
{{- end }}
{{- end }}
{{- end }}

{{- define "kvfleet.loraMount" -}}
{{- if or .Values.loraAdapters.existingClaim .Values.loraAdapters.hostPath }}
- name: lora-adapters
  mountPath: {{ .Values.loraAdapters.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "kvfleet.modelCacheMount" -}}
- name: models
  mountPath: {{ .Values.modelCache.mountPath }}
  readOnly: true
{{- end }}

{{/*
NATS and Redis credentials. Each lives in a Secret (the user's, or one this chart
creates for a bundled server) and reaches the roles through the environment, never
an argument: arguments show in /proc/<pid>/cmdline and in the pod spec.
*/}}
{{- define "kvfleet.natsSecretName" -}}
{{- default (include "kvfleet.componentName" (list . "nats")) .Values.nats.existingSecret }}
{{- end }}

{{/* How many gateways (each a Deployment of one pod, with a NATS user of its own). */}}
{{- define "kvfleet.gatewayCount" -}}
{{- $count := int .Values.gateway.replicas }}
{{- if lt $count 1 }}
{{- fail "gateway.replicas must be at least 1" }}
{{- end }}
{{- $count }}
{{- end }}

{{/* The name of gateway number i (its --gateway-name, one NATS subject token): its
token streams are kvfleet.out.<name>.<random>, and its NATS user, in the Secret under
"<name>-user" and "<name>-password", may read only those. Usage: include "kvfleet.gatewayName" 0 */}}
{{- define "kvfleet.gatewayName" -}}
{{- printf "gateway-%d" (int .) }}
{{- end }}

{{/* "true" when the roles log in to NATS: a bundled server always asks for it. */}}
{{- define "kvfleet.natsAuth" -}}
{{- if or .Values.nats.bundled .Values.nats.existingSecret }}true{{ end }}
{{- end }}

{{/* The NATS user of a role: "scheduler" (every scheduler), or a gateway's name
("gateway-0": each gateway its own), the Secret's keys "<that>-user" and
"<that>-password"; each user has only the subjects it needs.
Usage: include "kvfleet.natsEnv" (list $ "scheduler") */}}
{{- define "kvfleet.natsEnv" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- if include "kvfleet.natsAuth" $root }}
- name: KVFLEET_NATS_USER
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.natsSecretName" $root }}
      key: {{ $role }}-user
- name: KVFLEET_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.natsSecretName" $root }}
      key: {{ $role }}-password
{{- end }}
{{- end }}

{{- define "kvfleet.redisSecretName" -}}
{{- default (include "kvfleet.componentName" (list . "redis")) .Values.redis.existingSecret }}
{{- end }}

{{/* The Redis user the roles log in as: redis.username, or with the bundled Redis
"kvfleet", its ACL user (the default user is off there); empty: none (the password
alone, as requirepass wants). */}}
{{- define "kvfleet.redisUsername" -}}
{{- $name := .Values.redis.username | default (ternary "kvfleet" "" .Values.redis.bundled) }}
{{- if and $name (not (regexMatch "^[A-Za-z0-9_-]+$" $name)) }}
{{- fail "redis.username: letters, digits, \"-\" and \"_\" only" }}
{{- end }}
{{- $name }}
{{- end }}

{{/* The Redis password under the name given, when there is one (a bundled Redis
always has one); for the roles (KVFLEET_REDIS_PASSWORD), the user's name too.
Usage: include "kvfleet.redisEnv" (list $ "KVFLEET_REDIS_PASSWORD") */}}
{{- define "kvfleet.redisEnv" -}}
{{- $root := index . 0 -}}
{{- if or $root.Values.redis.bundled $root.Values.redis.existingSecret }}
- name: {{ index . 1 }}
  valueFrom:
    secretKeyRef:
      name: {{ include "kvfleet.redisSecretName" $root }}
      key: redis-password
{{- $username := include "kvfleet.redisUsername" $root }}
{{- if and $username (eq (index . 1) "KVFLEET_REDIS_PASSWORD") }}
- name: KVFLEET_REDIS_USERNAME
  value: {{ $username | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* A NetworkPolicy peer: this release's pods of the components given.
Usage: include "kvfleet.peer" (list $ "gateway" "replica") */}}
{{- define "kvfleet.peer" -}}
{{- $root := index . 0 -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/name: {{ include "kvfleet.name" $root }}
      app.kubernetes.io/instance: {{ $root.Release.Name }}
    matchExpressions:
      - key: app.kubernetes.io/component
        operator: In
        values: {{ rest . | toJson }}
{{- end }}

{{/*
The KV offload tiers on disk (values kvTiers): the flags, mounts and volumes of a
replica's scheduler and worker, which both need them (the scheduler finds blocks by
their file names, the worker reads and writes them).
*/}}
{{- define "kvfleet.kvTierArgs" -}}
{{- with .Values.kvTiers.localDisk }}{{ if .enabled }}
- --kv-offloading-dir=/kv-local
- --kv-offloading-dir-size={{ .sizeGiB }}
{{- end }}{{ end }}
{{- with .Values.kvTiers.shared }}{{ if .enabled }}
- --kv-shared-dir=/kv-shared
- --kv-shared-dir-size={{ .sizeGiB }}
{{- end }}{{ end }}
{{- end }}

{{- define "kvfleet.kvTierMounts" -}}
{{- if .Values.kvTiers.localDisk.enabled }}
- name: kv-local
  mountPath: /kv-local
{{- end }}
{{- if .Values.kvTiers.shared.enabled }}
- name: kv-shared
  mountPath: /kv-shared
{{- end }}
{{- end }}

{{- define "kvfleet.kvTierVolumes" -}}
{{- with .Values.kvTiers.localDisk }}{{ if .enabled }}
- name: kv-local
  emptyDir:
    sizeLimit: {{ add (int .sizeGiB) 1 }}Gi
{{- end }}{{ end }}
{{- with .Values.kvTiers.shared }}{{ if .enabled }}
- name: kv-shared
{{- if .existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .existingClaim }}
{{- else if .hostPath }}
  hostPath:
    path: {{ .hostPath }}
    type: DirectoryOrCreate
{{- else }}
{{- fail "kvTiers.shared.enabled needs kvTiers.shared.existingClaim (a ReadWriteMany claim) or kvTiers.shared.hostPath" }}
{{- end }}
{{- end }}{{ end }}
{{- end }}

{{/*
Several models behind the gateways (extraModels, docs/cluster.md): each extra model's
values, as a JSON list: the release's values with that model's model, engine flags and
replica count (none of the main model's engine flags), and modelKey, which names its
objects ("<fullname>-<modelKey>-replica", "-tokenizer", "-engine") and labels its pods
(kvfleet.io/model). Templates range over them after the main model, each as a root
context of its own (kvfleet.modelContext). Usage: include "kvfleet.extraModelValues" $ | fromJsonArray
*/}}
{{- define "kvfleet.extraModelValues" -}}
{{- $all := list }}
{{- range $index, $extra := .Values.extraModels }}
{{- if or (not $extra.model) (eq $extra.model $.Values.model) }}
{{- fail (printf "extraModels[%d].model must name a model other than model (%s)" $index $.Values.model) }}
{{- end }}
{{- $values := deepCopy $.Values }}
{{- $_ := set $values "model" $extra.model }}
{{- $_ := set $values "servedModelName" "" }}
{{- $_ := set $values "engine" (deepCopy ($extra.engine | default dict)) }}
{{- $_ := set $values "modelKey" (printf "model-%d" (add1 $index)) }}
{{- $_ := set $values.replica "replicas" ($extra.replicas | default 1) }}
{{- $_ := set $values.replica "enginePort" nil }}
{{- $_ := set $values.disaggregation "enabled" false }}
{{- with $extra.worker }}
{{- $_ := set $values.replica "worker" (mergeOverwrite (deepCopy $values.replica.worker) .) }}
{{- end }}
{{- $all = append $all $values }}
{{- end }}
{{- toJson $all }}
{{- end }}

{{/* A per-model object name: "<fullname>-<component>", or "<fullname>-<modelKey>-<component>" for an extra model. Usage: include "kvfleet.modelComponentName" (list . "replica") */}}
{{- define "kvfleet.modelComponentName" -}}
{{- $root := index . 0 -}}
{{- include "kvfleet.componentName" (list $root (printf "%s%s" (ternary (printf "%s-" ($root.Values.modelKey | default "")) "" (not (empty $root.Values.modelKey))) (index . 1))) }}
{{- end }}

{{/* The pod label that keeps the models' Deployments apart, once there are several: "main" for --model. */}}
{{- define "kvfleet.modelLabel" -}}
{{- if .Values.modelKey }}
kvfleet.io/model: {{ .Values.modelKey }}
{{- else if .Values.extraModels }}
kvfleet.io/model: main
{{- end }}
{{- end }}

{{/* The model and the engine flags as a ConfigMap, for one model's context. */}}
{{- define "kvfleet.engineConfigMap" -}}
apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ include "kvfleet.modelComponentName" (list . "engine") }}
  labels:
    {{- include "kvfleet.labels" (list . "engine") | nindent 4 }}
data:
  KVFLEET_MODEL: {{ .Values.model | quote }}
  KVFLEET_SERVED_MODEL_NAME: {{ default .Values.model .Values.servedModelName | quote }}
  {{- include "kvfleet.engineData" . | trim | nindent 2 }}
{{- end }}
