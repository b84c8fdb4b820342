{{/*
Helpers of the dashboard ConfigMap and the PrometheusRule (docs/observability.md).
*/}}

{{/* "stargate.metricsPrefix": the --metrics-prefix the replicas run with (serve.metricsPrefix;
null = the CLI default, stargate_; "" is a valid empty prefix). */}}
{{- define "stargate.metricsPrefix" -}}
{{- $prefix := .Values.serve.metricsPrefix }}
{{- ternary "stargate_" (toString $prefix) (kindIs "invalid" $prefix) }}
{{- end }}

{{/* "stargate.alertSelector": PromQL label matchers (no braces) that pick this release's series:
observability.alerts.selector, or by default the namespace and job the chart's ServiceMonitor
gives them (the Prometheus Operator names the job after the scraped Service, the headless one). */}}
{{- define "stargate.alertSelector" -}}
{{- $selector := .Values.observability.alerts.selector }}
{{- if kindIs "invalid" $selector }}
{{- printf "namespace=%q, job=%q" .Release.Namespace (include "stargate.headlessName" .) }}
{{- else }}
{{- $selector }}
{{- end }}
{{- end }}

{{/* "stargate.notReadyFor": how long the readiness gauge may stay 0 before StargateReplicaNotReady
fires. Explicit (observability.alerts.notReady.for) or derived: a warming replica is promoted at
the latest at readiness.warmupMs (CLI default 60000), and a leaving one reports not ready for
shutdown.delayMs + shutdown.drainTimeoutMs before it exits; the longer of the two, rounded up to
seconds, plus notReady.graceSeconds (scrape and evaluation lag). */}}
{{- define "stargate.notReadyFor" -}}
{{- $n := .Values.observability.alerts.notReady }}
{{- if not (kindIs "invalid" $n.for) }}
{{- $n.for }}
{{- else }}
{{- $r := .Values.readiness }}
{{- $warmup := ternary 60000 $r.warmupMs (kindIs "invalid" $r.warmupMs) | int64 }}
{{- $leaving := add (int64 .Values.shutdown.delayMs) (int64 .Values.shutdown.drainTimeoutMs) }}
{{- $ms := max $warmup $leaving }}
{{- printf "%ds" (add (div (add $ms 999) 1000) (int64 $n.graceSeconds)) }}
{{- end }}
{{- end }}

{{/* "stargate.dashboardJson": helm/stargate/dashboards/stargate.json with the metric prefix of
this release (the file names the default, stargate_; the llmkube_modelpool_ names are fixed), and a
uid and title of its own, so two releases' dashboards do not replace each other in Grafana. */}}
{{- define "stargate.dashboardJson" -}}
{{- $json := .Files.Get "dashboards/stargate.json" }}
{{- $json = regexReplaceAllLiteral "\\bstargate_" $json (include "stargate.metricsPrefix" .) }}
{{- $uid := printf "stargate-%s" (sha256sum (printf "%s/%s" .Release.Namespace (include "stargate.fullname" .)) | trunc 16) }}
{{- $json = replace "\"uid\": \"stargate-router\"" (printf "\"uid\": %q" $uid) $json }}
{{- $json = replace "\"title\": \"Stargate router\"" (printf "\"title\": %q" (printf "Stargate router (%s/%s)" .Release.Namespace (include "stargate.fullname" .))) $json }}
{{- $json }}
{{- end }}
