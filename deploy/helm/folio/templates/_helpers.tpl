{{/* The release's name for every object: the release name, with the chart's if it lacks it. */}}
{{- define "folio.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "folio.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "folio.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "folio.routerLabels" -}}
{{ include "folio.routerSelectorLabels" . }}
app.kubernetes.io/version: {{ .Values.router.image.tag | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "folio.labels" -}}
{{ include "folio.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The waiting requests of this release's pods (NAME-<replicaset hash>-<id>,
     so not those of a release named NAME-something), summed: the KEDA trigger's
     query (KEDA divides it by the replica count for an AverageValue target). */}}
{{- define "folio.waitingQuery" -}}
sum(folio:num_requests_waiting{namespace="{{ .Release.Namespace }}",pod=~"{{ include "folio.fullname" . }}-[a-z0-9]+-[a-z0-9]+"})
{{- end -}}

{{/* The HPA behaviour, shared by the HPA and KEDA's HPA. */}}
{{- define "folio.behavior" -}}
scaleUp:
  stabilizationWindowSeconds: {{ .Values.autoscaling.scaleUp.stabilizationWindowSeconds }}
  policies:
    - type: Pods
      value: {{ .Values.autoscaling.scaleUp.pods }}
      periodSeconds: {{ .Values.autoscaling.scaleUp.periodSeconds }}
scaleDown:
  stabilizationWindowSeconds: {{ .Values.autoscaling.scaleDown.stabilizationWindowSeconds }}
  policies:
    - type: Pods
      value: {{ .Values.autoscaling.scaleDown.pods }}
      periodSeconds: {{ .Values.autoscaling.scaleDown.periodSeconds }}
{{- end -}}

{{/* The usage ledger's claim: an existing one, or the chart's. */}}
{{- define "folio.usageClaim" -}}
{{- .Values.usageDb.existingClaim | default (printf "%s-usage" (include "folio.fullname" .)) -}}
{{- end -}}

{{- define "folio.checkValues" -}}
{{- $a := .Values.autoscaling -}}
{{- if not (has $a.mode (list "hpa" "keda" "none")) -}}
{{- fail (printf "autoscaling.mode must be hpa, keda or none, not %q" $a.mode) -}}
{{- end -}}
{{- if and (ne $a.mode "none") (lt (int $a.minReplicas) 1) -}}
{{- fail "autoscaling.minReplicas must be at least 1: the waiting queue is empty when no pod runs, so it cannot scale from zero (that needs a request-count signal from in front of the pods)" -}}
{{- end -}}
{{- if and (ne $a.mode "none") (lt (int $a.maxReplicas) (int $a.minReplicas)) -}}
{{- fail "autoscaling.maxReplicas must be at least autoscaling.minReplicas" -}}
{{- end -}}
{{- if not (has .Values.accelerator (list "cpu" "gpu")) -}}
{{- fail (printf "accelerator must be cpu or gpu, not %q" .Values.accelerator) -}}
{{- end -}}
{{- if not (has .Values.modelVolume.type (list "pvc" "hostPath")) -}}
{{- fail (printf "modelVolume.type must be pvc or hostPath, not %q" .Values.modelVolume.type) -}}
{{- end -}}
{{- if and .Values.usageDb.enabled (or (ne $a.mode "none") (ne (int .Values.replicaCount) 1)) -}}
{{- fail "usageDb.enabled needs one replica (autoscaling.mode none, replicaCount 1): the ledger is one SQLite file that one pod writes" -}}
{{- end -}}
{{- if and .Values.apiKeysFile.existingSecret (not .Values.apiKeysFile.key) -}}
{{- fail "apiKeysFile.key must name the Secret's key that holds the keys file" -}}
{{- end -}}
{{- if lt (float64 .Values.cost.perHour) 0.0 -}}
{{- fail "cost.perHour must be 0 (not set) or more" -}}
{{- end -}}
{{- $r := .Values.router -}}
{{- if and $r.enabled (not (has $r.policy (list "cache_aware" "round_robin" "power_of_two" "consistent_hash" "random"))) -}}
{{- fail (printf "router.policy must be cache_aware, round_robin, power_of_two, consistent_hash or random, not %q" $r.policy) -}}
{{- end -}}
{{- if and $r.enabled (lt (int $r.replicaCount) 1) -}}
{{- fail "router.replicaCount must be at least 1" -}}
{{- end -}}
{{- if and $r.enabled (eq (int $r.port) (int $r.metricsPort)) -}}
{{- fail "router.port and router.metricsPort must differ" -}}
{{- end -}}
{{- end -}}
