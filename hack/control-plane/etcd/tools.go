//go:build tools

// Package tools pins the command hack/control-plane-bin.sh builds.
package tools

import _ "go.etcd.io/etcd/server/v3"
