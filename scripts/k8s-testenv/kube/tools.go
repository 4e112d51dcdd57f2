//go:build tools

// Package tools pins the Kubernetes commands this module builds, so `go mod tidy` keeps their
// dependencies. The module exists only to build them (see ../../k8s-testenv.sh).
package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
