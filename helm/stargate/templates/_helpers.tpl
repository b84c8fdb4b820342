{{/*
Names and labels.
*/}}
{{- define "stargate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stargate.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "stargate.headlessName" -}}
{{- printf "%s-headless" (include "stargate.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{- define "stargate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "stargate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stargate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "stargate.labels" -}}
helm.sh/chart: {{ include "stargate.chart" . }}
{{ include "stargate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "stargate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "stargate.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "stargate.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The headless Service's FQDN: its A records are the replicas (peer discovery). */}}
{{- define "stargate.discoveryDnsName" -}}
{{- printf "%s.%s.svc.%s" (include "stargate.headlessName" .) .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/*
"stargate.int": a number as plain decimal digits. Helm decodes every number in values as
float64, and `{{ 1000000.0 }}` prints `1e+06`, which a strict integer CLI rejects. Integral
floats are printed with %d; anything else (a fraction, a string) is printed as is so that the
CLI, not the chart, rejects it.
*/}}
{{- define "stargate.int" -}}
{{- if kindIs "float64" . }}
{{- if eq (float64 (int64 .)) . }}{{ printf "%d" (int64 .) }}{{ else }}{{ printf "%v" . }}{{ end }}
{{- else if kindIs "bool" . }}
{{- printf "%t" . }}
{{- else }}
{{- printf "%v" . }}
{{- end }}
{{- end }}

{{/* Pool config file contents (a map rendered with toYaml, or a YAML string verbatim). */}}
{{- define "stargate.poolConfig" -}}
{{- if kindIs "string" .Values.pools.config }}
{{- .Values.pools.config }}
{{- else }}
{{- toYaml .Values.pools.config }}
{{- end }}
{{- end }}

{{/*
"stargate.metricsListenAddr": <metrics.listenHost or 0.0.0.0>:<ports.metrics>, an IPv6 host in
brackets. The port is always ports.metrics, so the containerPort, the headless Service and the
ServiceMonitor stay on the port the listener binds.
*/}}
{{- /* HTTPS for the kubelet's probes when the HTTP listener serves TLS (it does not verify). */}}
{{- define "stargate.probeScheme" -}}
{{- if or .Values.tls.secretName (not (kindIs "invalid" .Values.serve.tlsCertPath)) }}HTTPS{{ else }}HTTP{{ end }}
{{- end }}

{{- define "stargate.metricsListenAddr" -}}
{{- $host := toString (default "0.0.0.0" .Values.metrics.listenHost) }}
{{- if and (contains ":" $host) (not (hasPrefix "[" $host)) }}
{{- $host = printf "[%s]" $host }}
{{- end }}
{{- printf "%s:%s" $host (include "stargate.int" .Values.ports.metrics) }}
{{- end }}

{{/*
"stargate.kubernetesPools": "true" when the pools use the kubernetes member controller:
pools.kubernetesController, or a pool in pools.config (a map or a YAML string) whose
controller.kind is kubernetes.
*/}}
{{- define "stargate.kubernetesPools" -}}
{{- ternary "true" "false" (or (eq (toString .Values.pools.kubernetesController) "true") (include "stargate.kubernetesPoolsInConfig" . | eq "true")) }}
{{- end }}

{{/*
"stargate.kubernetesPoolsInConfig": "true" when a pool in pools.config uses the kubernetes
member controller: such pools are shared by the replicas through Leases.
*/}}
{{- define "stargate.kubernetesPoolsInConfig" -}}
{{- $found := false }}
{{- $config := .Values.pools.config }}
{{- if kindIs "string" $config }}
{{- $config = fromYaml $config }}
{{- end }}
{{- if kindIs "map" $config }}
{{- $pools := get $config "pools" }}
{{- if kindIs "slice" $pools }}
{{- range $pool := $pools }}
{{- if kindIs "map" $pool }}
{{- $controller := get $pool "controller" }}
{{- if and (kindIs "map" $controller) (eq (toString (get $controller "kind")) "kubernetes") }}
{{- $found = true }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- ternary "true" "false" (eq (toString $found) "true") }}
{{- end }}

{{/*
Render-time guards (fail early instead of producing a broken release).
*/}}
{{- define "stargate.validate" -}}
{{- $s := .Values.serve }}
{{- if and .Values.pools.enabled (not (kindIs "invalid" $s.poolConfig)) }}
{{- fail "serve.poolConfig cannot be set when pools.enabled is true (the chart passes --pool-config=/etc/stargate/pools.yaml)" }}
{{- end }}
{{- if and .Values.pools.enabled (empty .Values.pools.config) }}
{{- fail "pools.enabled requires pools.config (the --pool-config file contents)" }}
{{- end }}
{{- if and (gt (int64 .Values.replicaCount) 1) (eq (toString $s.disableDnsDiscovery) "true") }}
{{- fail "serve.disableDnsDiscovery cannot be true when replicaCount is greater than 1; multi-replica routers require DNS discovery" }}
{{- end }}
{{- /* Kubernetes pools are shared by every replica through one Lease per pool (the chart passes
--pool-ownership=lease; docs/pool-ownership.md), so any replicaCount works. The lease timings
must let an owner stop deciding before its Lease can expire. */}}
{{- $duration := ternary 15000 $s.poolLeaseDurationMs (kindIs "invalid" $s.poolLeaseDurationMs) | int64 }}
{{- $renew := ternary 10000 $s.poolLeaseRenewDeadlineMs (kindIs "invalid" $s.poolLeaseRenewDeadlineMs) | int64 }}
{{- $retry := ternary 2000 $s.poolLeaseRetryPeriodMs (kindIs "invalid" $s.poolLeaseRetryPeriodMs) | int64 }}
{{- if not (and (lt $retry $renew) (lt $renew $duration)) }}
{{- fail (printf "serve.poolLeaseRetryPeriodMs (%d) < serve.poolLeaseRenewDeadlineMs (%d) < serve.poolLeaseDurationMs (%d) must hold: an owner must stop deciding before its Lease can expire" $retry $renew $duration) }}
{{- end }}
{{- $metricsHost := toString (default "0.0.0.0" .Values.metrics.listenHost) }}
{{- if and (or .Values.metrics.enabled .Values.metrics.serviceMonitor.enabled) (or (hasPrefix "127." $metricsHost) (has $metricsHost (list "localhost" "::1" "[::1]"))) }}
{{- fail (printf "metrics.listenHost %s is a loopback address: Prometheus cannot scrape it through the headless Service; unset metrics.enabled and metrics.serviceMonitor.enabled, or use another host" $metricsHost) }}
{{- end }}
{{- if .Values.podDisruptionBudget.enabled }}
{{- $max := not (kindIs "invalid" .Values.podDisruptionBudget.maxUnavailable) }}
{{- $min := not (kindIs "invalid" .Values.podDisruptionBudget.minAvailable) }}
{{- if eq $max $min }}
{{- fail "podDisruptionBudget: set exactly one of maxUnavailable and minAvailable" }}
{{- end }}
{{- end }}
{{- $s := .Values.serve }}
{{- if and .Values.tls.secretName (or (not (kindIs "invalid" $s.tlsCertPath)) (not (kindIs "invalid" $s.tlsKeyPath))) }}
{{- fail "set either tls.secretName (the chart mounts it and passes --tls-cert-path/--tls-key-path) or serve.tlsCertPath/serve.tlsKeyPath, not both" }}
{{- end }}
{{- if and .Values.tunnels.tlsSecretName (or (not (kindIs "invalid" $s.quicTlsCertPath)) (not (kindIs "invalid" $s.quicTlsKeyPath))) }}
{{- fail "set either tunnels.tlsSecretName (the chart mounts it and passes --quic-tls-cert-path/--quic-tls-key-path) or serve.quicTlsCertPath/serve.quicTlsKeyPath, not both" }}
{{- end }}
{{- if ne (kindIs "invalid" $s.tlsCertPath) (kindIs "invalid" $s.tlsKeyPath) }}
{{- fail "serve.tlsCertPath and serve.tlsKeyPath go together (--tls-key-path is required with --tls-cert-path)" }}
{{- end }}
{{- if and .Values.secretsFile.secretName (not (kindIs "invalid" $s.secretsPath)) }}
{{- fail "set either secretsFile.secretName (the chart mounts it and passes --secrets-path) or serve.secretsPath, not both" }}
{{- end }}
{{- if and (not (kindIs "invalid" $s.oauth2ProviderHost)) (not .Values.secretsFile.secretName) (kindIs "invalid" $s.secretsPath) }}
{{- fail "serve.oauth2ProviderHost requires a secrets file (secretsFile.secretName or serve.secretsPath): it holds the OAuth2 client credentials" }}
{{- end }}
{{- /* minReadySeconds must cover the warmup stability window (docs/decisions.md, D2; Istio #21228). */}}
{{- $r := .Values.readiness }}
{{- $warmup := ternary 60000 $r.warmupMs (kindIs "invalid" $r.warmupMs) | int64 }}
{{- $interval := ternary 1000 $r.warmupSampleIntervalMs (kindIs "invalid" $r.warmupSampleIntervalMs) | int64 }}
{{- $window := ternary 5 $r.warmupStabilizationWindow (kindIs "invalid" $r.warmupStabilizationWindow) | int64 }}
{{- $stability := min $warmup (mul $interval $window) }}
{{- if gt $stability (mul (int64 .Values.minReadySeconds) 1000) }}
{{- fail (printf "minReadySeconds (%d) must cover the readiness warmup stability window (%d ms = readiness.warmupSampleIntervalMs x readiness.warmupStabilizationWindow, capped by readiness.warmupMs)" (int64 .Values.minReadySeconds) $stability) }}
{{- end }}
{{- end }}

{{/*
"stargate.args": the `stargate serve` arguments as a JSON list. Chart-managed flags first, then
every `readiness` and `serve` key that is present (not null), then extraArgs. Presence, not
truthiness, decides: 0, false and "" are rendered.
*/}}
{{- define "stargate.args" -}}
{{- $v := .Values }}
{{- $s := $v.serve }}
{{- $r := $v.readiness }}
{{- $args := list }}
{{- $args = append $args (printf "--stargate-id=%s" (ternary "$(POD_NAME)" (toString $s.stargateId) (kindIs "invalid" $s.stargateId))) }}
{{- $args = append $args (printf "--http-listen-addr=0.0.0.0:%s" (include "stargate.int" $v.ports.http)) }}
{{- $args = append $args (printf "--listen-addr=0.0.0.0:%s" (include "stargate.int" $v.ports.grpc)) }}
{{- $args = append $args (printf "--model-discovery-listen-addr=0.0.0.0:%s" (include "stargate.int" $v.ports.discovery)) }}
{{- $advertise := printf "$(POD_IP):%s" (include "stargate.int" $v.ports.grpc) }}
{{- $args = append $args (printf "--advertise-addr=%s" (ternary $advertise (toString $s.advertiseAddr) (kindIs "invalid" $s.advertiseAddr))) }}
{{- /* Static discovery (serve.peer) replaces the DNS name unless one is set explicitly. */}}
{{- if not (kindIs "invalid" $s.stargateDiscoveryDnsName) }}
{{- $args = append $args (printf "--stargate-discovery-dns-name=%s" $s.stargateDiscoveryDnsName) }}
{{- else if empty $s.peer }}
{{- $args = append $args (printf "--stargate-discovery-dns-name=%s" (include "stargate.discoveryDnsName" .)) }}
{{- end }}
{{- $args = append $args (printf "--metrics-listen-addr=%s" (include "stargate.metricsListenAddr" .)) }}
{{- $args = append $args (printf "--shutdown-delay-ms=%s" (include "stargate.int" $v.shutdown.delayMs)) }}
{{- $args = append $args (printf "--shutdown-drain-timeout-ms=%s" (include "stargate.int" $v.shutdown.drainTimeoutMs)) }}
{{- range $pair := list (list "warmupMs" "--readiness-warmup-ms") (list "warmupSampleIntervalMs" "--warmup-sample-interval-ms") (list "warmupStabilizationWindow" "--warmup-stabilization-window") }}
{{- $val := index $r (index $pair 0) }}
{{- if not (kindIs "invalid" $val) }}
{{- $args = append $args (printf "%s=%s" (index $pair 1) (include "stargate.int" $val)) }}
{{- end }}
{{- end }}
{{- if $v.pools.enabled }}
{{- $args = append $args "--pool-config=/etc/stargate/pools.yaml" }}
{{- /* Kubernetes pools are shared through Leases (docs/pool-ownership.md); serve.pool* values
given explicitly replace these. */}}
{{- if and (include "stargate.kubernetesPoolsInConfig" . | eq "true") (kindIs "invalid" $s.poolOwnership) }}
{{- $args = append $args "--pool-ownership=lease" }}
{{- if kindIs "invalid" $s.poolLeasePrefix }}
{{- $args = append $args (printf "--pool-lease-prefix=%s" (include "stargate.fullname" .)) }}
{{- end }}
{{- if kindIs "invalid" $s.poolLeaseNamespace }}
{{- $args = append $args "--pool-lease-namespace=$(POD_NAMESPACE)" }}
{{- end }}
{{- if kindIs "invalid" $s.poolOwnerUrl }}
{{- $args = append $args (printf "--pool-owner-url=%s://$(POD_IP):%s" (include "stargate.probeScheme" . | lower) (include "stargate.int" $v.ports.http)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if $v.tls.secretName }}
{{- $args = append $args (printf "--tls-cert-path=%s/tls.crt" $v.tls.mountPath) }}
{{- $args = append $args (printf "--tls-key-path=%s/tls.key" $v.tls.mountPath) }}
{{- end }}
{{- if $v.secretsFile.secretName }}
{{- $args = append $args (printf "--secrets-path=%s/%s" $v.secretsFile.mountPath $v.secretsFile.key) }}
{{- end }}
{{- /* The reverse tunnel listener (docs/tunnels.md) on ports.reverseTunnel (UDP); serve.* values
given explicitly replace these. */}}
{{- if $v.tunnels.tlsSecretName }}
{{- $args = append $args (printf "--quic-tls-cert-path=%s/tls.crt" $v.tunnels.tlsMountPath) }}
{{- $args = append $args (printf "--quic-tls-key-path=%s/tls.key" $v.tunnels.tlsMountPath) }}
{{- end }}
{{- if $v.tunnels.reverse }}
{{- if kindIs "invalid" $s.backendConnectivity }}
{{- $args = append $args "--backend-connectivity=reverse" }}
{{- end }}
{{- if kindIs "invalid" $s.reverseTunnelListenAddr }}
{{- $args = append $args (printf "--reverse-tunnel-listen-addr=0.0.0.0:%s" (include "stargate.int" $v.ports.reverseTunnel)) }}
{{- end }}
{{- end }}
{{- /* [key, flag, kind]: value = --flag=<v>; switch = bare --flag when true; toggle = --flag when
true, --no-flag when false; list = one --flag=<item> each */}}
{{- $flags := list
  (list "peer" "--peer" "list")
  (list "disableDnsDiscovery" "--disable-dns-discovery" "switch")
  (list "peerAbsentAfterMs" "--peer-absent-after-ms" "value")
  (list "dnsPollMs" "--dns-poll-ms" "value")
  (list "watchHeartbeatMs" "--watch-heartbeat-ms" "value")
  (list "remoteStargateUrl" "--remote-stargate-url" "list")
  (list "grpcPylonDialAddr" "--grpc-pylon-dial-addr" "value")
  (list "registrationUpdateIdleTimeoutMs" "--registration-update-idle-timeout-ms" "value")
  (list "registrationUpdateMaxIdleTimeoutMs" "--registration-update-max-idle-timeout-ms" "value")
  (list "grpcMaxMessageBytes" "--grpc-max-message-bytes" "value")
  (list "workerAuthEndpoint" "--worker-auth-endpoint" "value")
  (list "registrationTokenFile" "--registration-token-file" "value")
  (list "workerAuthCaFile" "--worker-auth-ca-file" "value")
  (list "secretsPath" "--secrets-path" "value")
  (list "secretsJsonPath" "--secrets-json-path" "value")
  (list "oauth2ProviderHost" "--oauth2-provider-host" "value")
  (list "healthCheckTimeoutMs" "--health-check-timeout-ms" "value")
  (list "backendConnectivity" "--backend-connectivity" "value")
  (list "tunnelProtocol" "--tunnel-protocol" "value")
  (list "directQuicConnections" "--direct-quic-connections" "value")
  (list "reverseTunnelListenAddr" "--reverse-tunnel-listen-addr" "value")
  (list "reverseTunnelPylonDialAddr" "--reverse-tunnel-pylon-dial-addr" "value")
  (list "reverseTunnelConnectTimeoutMs" "--reverse-tunnel-connect-timeout-ms" "value")
  (list "quicConnectTimeoutMs" "--quic-connect-timeout-ms" "value")
  (list "quicRequestTimeoutMs" "--quic-request-timeout-ms" "value")
  (list "quicInsecure" "--quic-insecure" "switch")
  (list "quicTlsCertPath" "--quic-tls-cert-path" "value")
  (list "quicTlsKeyPath" "--quic-tls-key-path" "value")
  (list "proxyMaxConnectRetries" "--proxy-max-connect-retries" "value")
  (list "proxyMaxRequestRetries" "--proxy-max-request-retries" "value")
  (list "proxyMaxReplayBodyBytes" "--proxy-max-replay-body-bytes" "value")
  (list "proxyRequirePylonRetrySignal" "--proxy-require-pylon-retry-signal" "value")
  (list "proxyRetryBudgetHeader" "--proxy-retry-budget-header" "value")
  (list "proxyResponseHeaderTimeoutMs" "--proxy-response-header-timeout-ms" "value")
  (list "proxyConnectTimeoutMs" "--proxy-connect-timeout-ms" "value")
  (list "proxyMaxConnectionsPerBackend" "--proxy-max-connections-per-backend" "value")
  (list "acceptOpenaiRequests" "--accept-openai-requests" "switch")
  (list "unmeasuredBackends" "--unmeasured-backends" "value")
  (list "outlierConsecutiveFailures" "--outlier-consecutive-failures" "value")
  (list "outlierBaseEjectionMs" "--outlier-base-ejection-ms" "value")
  (list "outlierMaxEjectionMs" "--outlier-max-ejection-ms" "value")
  (list "outlierMaxEjectionPercent" "--outlier-max-ejection-percent" "value")
  (list "outlierDecayIntervalMs" "--outlier-decay-interval-ms" "value")
  (list "slowStartWindowMs" "--slow-start-window-ms" "value")
  (list "slowStartAggression" "--slow-start-aggression" "value")
  (list "slowStartMinWeightPercent" "--slow-start-min-weight-percent" "value")
  (list "deriveAffinityKey" "--derive-affinity-key" "switch")
  (list "deriveAffinityKeyBlockBytes" "--derive-affinity-key-block-bytes" "value")
  (list "deriveAffinityKeyDepth" "--derive-affinity-key-depth" "value")
  (list "loadingComments" "--loading-comments" "toggle")
  (list "loadingCommentIntervalMs" "--loading-comment-interval-ms" "value")
  (list "lbConfigPath" "--lb-config-path" "value")
  (list "upstreamCaFile" "--upstream-ca-file" "value")
  (list "tlsCertPath" "--tls-cert-path" "value")
  (list "tlsKeyPath" "--tls-key-path" "value")
  (list "tlsReloadIntervalMs" "--tls-reload-interval-ms" "value")
  (list "otelEndpoint" "--otel-endpoint" "value")
  (list "otelServiceName" "--otel-service-name" "value")
  (list "poolConfig" "--pool-config" "value")
  (list "poolResyncIntervalMs" "--pool-resync-interval-ms" "value")
  (list "poolControllerTimeoutMs" "--pool-controller-timeout-ms" "value")
  (list "poolBreakerFailures" "--pool-breaker-failures" "value")
  (list "poolBreakerCooldownMs" "--pool-breaker-cooldown-ms" "value")
  (list "poolOwnership" "--pool-ownership" "value")
  (list "poolLeaseNamespace" "--pool-lease-namespace" "value")
  (list "poolLeasePrefix" "--pool-lease-prefix" "value")
  (list "poolLeaseDurationMs" "--pool-lease-duration-ms" "value")
  (list "poolLeaseRenewDeadlineMs" "--pool-lease-renew-deadline-ms" "value")
  (list "poolLeaseRetryPeriodMs" "--pool-lease-retry-period-ms" "value")
  (list "poolOwnerUrl" "--pool-owner-url" "value")
  (list "requestBodyTimeoutMs" "--request-body-timeout-ms" "value")
  (list "maxClientConnections" "--max-client-connections" "value")
  (list "metricsPrefix" "--metrics-prefix" "value")
  (list "debugEndpoints" "--debug-endpoints" "toggle")
  (list "logLevel" "--log-level" "value")
  (list "logFormat" "--log-format" "value")
}}
{{- range $f := $flags }}
{{- $val := index $s (index $f 0) }}
{{- $flag := index $f 1 }}
{{- $kind := index $f 2 }}
{{- if not (kindIs "invalid" $val) }}
{{- if eq $kind "switch" }}
{{- if eq (toString $val) "true" }}
{{- $args = append $args $flag }}
{{- end }}
{{- else if eq $kind "toggle" }}
{{- $args = append $args (ternary $flag (printf "--no-%s" (trimPrefix "--" $flag)) (eq (toString $val) "true")) }}
{{- else if eq $kind "list" }}
{{- range $item := $val }}
{{- $args = append $args (printf "%s=%s" $flag (include "stargate.int" $item)) }}
{{- end }}
{{- else }}
{{- $args = append $args (printf "%s=%s" $flag (include "stargate.int" $val)) }}
{{- end }}
{{- end }}
{{- end }}
{{- range $extra := $v.extraArgs }}
{{- $args = append $args (include "stargate.int" $extra) }}
{{- end }}
{{- toJson $args }}
{{- end }}
