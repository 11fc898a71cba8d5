//go:build tools

// The node binaries ./build makes: importing them here keeps their dependencies in go.sum.

package node

import (
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
