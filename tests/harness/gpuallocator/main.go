// Reads cases as JSON lines {"available":[..],"required":[..],"size":n} and
// prints go-gpuallocator's best-effort choice for each, as GPU indexes.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/NVIDIA/go-gpuallocator/gpuallocator"
)

type request struct {
	Available []int `json:"available"`
	Required  []int `json:"required"`
	Size      int   `json:"size"`
}

func main() {
	devices, err := gpuallocator.NewDevices()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	policy := gpuallocator.NewBestEffortPolicy()
	in := bufio.NewScanner(os.Stdin)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var r request
		if err := json.Unmarshal(in.Bytes(), &r); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		pick := func(idx []int) []*gpuallocator.Device {
			var ds []*gpuallocator.Device
			for _, i := range idx {
				ds = append(ds, devices[i])
			}
			return ds
		}
		chosen := []int{}
		for _, d := range policy.Allocate(pick(r.Available), pick(r.Required), r.Size) {
			chosen = append(chosen, d.Index)
		}
		sort.Ints(chosen)
		if err := out.Encode(chosen); err != nil {
			os.Exit(3)
		}
	}
}
