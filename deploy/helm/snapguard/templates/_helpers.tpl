{{/* Names and labels shared by the chart's templates. */}}

{{- define "snapguard.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's prefix for every object: the release name, with the chart's name unless it holds it. */}}
{{- define "snapguard.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "snapguard.labels" -}}
app.kubernetes.io/name: {{ include "snapguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Selector labels of one component: include "snapguard.selector" (list . "agent") */}}
{{- define "snapguard.selector" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "snapguard.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "snapguard.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "snapguard.agent.name" -}}{{ include "snapguard.fullname" . }}-agent{{- end -}}
{{- define "snapguard.webhook.name" -}}{{ include "snapguard.fullname" . }}-webhook{{- end -}}
{{- define "snapguard.webhook.secret" -}}
{{- .Values.webhook.tls.secretName | default (printf "%s-tls" (include "snapguard.webhook.name" .)) -}}
{{- end -}}

{{/* The host's namespaces the agent's commands run in (host mode): nsenter into PID 1's. */}}
{{- define "snapguard.nsenter" -}}
- nsenter
- --target=1
- --mount
- --uts
- --ipc
- --net
- --
{{- end -}}

{{/* The helm-generated CA and serving certificate (webhook.tls.mode helm) as JSON of base64 PEM:
crt, key, ca. Generated once per render and shared by the Secret and the caBundle; an existing
Secret with a CA is kept (lookup; `helm template` sees none and generates). */}}
{{- define "snapguard.webhook.certs" -}}
{{- if not (hasKey .Values.webhook.tls "generated") -}}
{{- $svc := include "snapguard.webhook.name" . -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "snapguard.webhook.secret" .) -}}
{{- $out := dict -}}
{{- if and $old $old.data (index $old.data "ca.crt") -}}
{{- $out = dict "crt" (index $old.data "tls.crt") "key" (index $old.data "tls.key") "ca" (index $old.data "ca.crt") -}}
{{- else -}}
{{- $days := int .Values.webhook.tls.validityDays -}}
{{- $names := list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) -}}
{{- $caCert := genCA (printf "%s-ca" $svc) $days -}}
{{- $cert := genSignedCert (printf "%s.%s.svc" $svc .Release.Namespace) nil $names $days $caCert -}}
{{- $out = dict "crt" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc) "ca" ($caCert.Cert | b64enc) -}}
{{- end -}}
{{- $_ := set .Values.webhook.tls "generated" $out -}}
{{- end -}}
{{- toJson .Values.webhook.tls.generated -}}
{{- end -}}
