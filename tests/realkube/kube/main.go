// One binary for etcd and the Kubernetes components the real-cluster tests
// run, chosen by its name (a link to it) or its first argument. Linking them
// together compiles the packages they share once: on the 2-core test
// machines that is most of the build time.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	_ "time/tzdata"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

const usage = "usage: kube etcd|kube-apiserver|kube-controller-manager|kube-scheduler|kubelet [flags]"

func main() {
	name := filepath.Base(os.Args[0])
	args := os.Args[1:]
	if name == "kube" {
		if len(args) == 0 {
			fmt.Fprintln(os.Stderr, usage)
			os.Exit(2)
		}
		name, args = args[0], args[1:]
	}
	var command *cobra.Command
	switch name {
	case "etcd":
		etcdmain.Main(append([]string{"etcd"}, args...))
		return
	case "kube-apiserver":
		command = apiserver.NewAPIServerCommand()
	case "kube-controller-manager":
		command = controllermanager.NewControllerManagerCommand()
	case "kube-scheduler":
		command = scheduler.NewSchedulerCommand()
	case "kubelet":
		command = kubelet.NewKubeletCommand(context.Background())
	default:
		fmt.Fprintln(os.Stderr, usage)
		os.Exit(2)
	}
	command.SetArgs(args)
	os.Exit(cli.Run(command))
}
