//! kinference-testgw: a test gateway that behaves like Envoy toward an endpoint picker.
