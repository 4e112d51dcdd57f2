//go:build tools

// Package tools pins the etcd server this module builds, so `go mod tidy` keeps its dependencies.
// etcd's own go.mod has relative replaces, which is why it is built from here
// (see ../../k8s-testenv.sh).
package tools

import _ "go.etcd.io/etcd/server/v3"
