//! kinference-epp: the endpoint picker (Envoy ext_proc, the Gateway API Inference Extension protocol).
