{{- /*
Origin: kubernetes-sigs/gateway-api-inference-extension, config/charts/inferencepool/templates/epp-deployment.yaml
at commit 9d1514a3607eefbda6bcf8849aaf3654dba7f207 (Apache-2.0): the `epp` container's args and probes,
verbatim. tests/deploy/test_chart_args.py renders them for the chart's defaults and runs our CLI with them.
*/ -}}
        args:
        - --pool-name
        - {{ .Release.Name }}
        # The pool namespace is optional because EPP can default to the NAMESPACE env var.
        # We still keep this here so that the template works with older versions of EPP, or other
        # distros of EPP which may not have implemented the NAMESPACE env var defaulting behavior.
        - --pool-namespace
        - {{ .Release.Namespace }}
        {{- if ne .Values.inferencePool.apiVersion "inference.networking.k8s.io" }}
        - --pool-group
        - "{{ (split "/" .Values.inferencePool.apiVersion)._0 }}"
        {{- end }}
        - --zap-encoder
        - "json"
        - --config-file
        - "/config/{{ .Values.inferenceExtension.pluginsConfigFile }}"
        {{- if eq (.Values.inferencePool.modelServerType | default "vllm") "triton-tensorrt-llm" }}
        - --total-queued-requests-metric
        - "nv_trt_llm_request_metrics{request_type=waiting}"
        - --kv-cache-usage-percentage-metric
        - "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}"
        - --lora-info-metric
        - "" # Set an empty metric to disable LoRA metric scraping as they are not supported by Triton yet.
        {{- end }}
        {{- if gt (.Values.inferenceExtension.replicas | int) 1 }}
        - --ha-enable-leader-election
        {{- end }}
        # Pass additional flags via the inferenceExtension.flags field in values.yaml.
        {{- range $key, $value := .Values.inferenceExtension.flags }}
        - --{{ $key }}
        - "{{ $value }}"
        {{- end }}
        {{- if .Values.inferenceExtension.tracing.enabled }}
        - --tracing=true
        {{- else }}
        - --tracing=false
        {{- end }}
        {{- if not .Values.inferenceExtension.monitoring.prometheus.enabled }}
        - --metrics-endpoint-auth=false
        {{- end }}
        ports:
        - name: grpc
          containerPort: 9002
        - name: grpc-health
          containerPort: 9003
        - name: metrics
          containerPort: 9090
        {{- if .Values.inferenceExtension.extraContainerPorts }}
        {{- toYaml .Values.inferenceExtension.extraContainerPorts | nindent 8 }}
        {{- end }}
        livenessProbe:
          {{- if gt (.Values.inferenceExtension.replicas | int) 1 }}
          grpc:
            port: 9003
            service: liveness
          {{- else }}
          grpc:
            port: 9003
            service: inference-extension
          {{- end }}
          initialDelaySeconds: 5
          periodSeconds: 10
        readinessProbe:
          {{- if gt (.Values.inferenceExtension.replicas | int) 1 }}
          grpc:
            port: 9003
            service: readiness
          {{- else }}
          grpc:
            port: 9003
            service: inference-extension
          {{- end }}
          periodSeconds: 2
