/* The portable workload kernel, shared by cgpu-burn and the benchmarks: real
 * PTX that spins on the device's nanosecond timer for its one u64 parameter's
 * worth of nanoseconds, so its cost is known without knowing the GPU (the
 * simulation charges exactly that). Header only; no state. */
#ifndef CGPU_SPIN_KERNEL_H
#define CGPU_SPIN_KERNEL_H

#define CGPU_SPIN_ENTRY "cgpu_spin"

static const char cgpu_spin_ptx[] = ".version 7.0\n.target sm_70\n.address_size 64\n\n"
                               ".visible .entry cgpu_spin(.param .u64 cgpu_spin_ns)\n{\n"
                               "\t.reg .pred %p<2>;\n\t.reg .b64 %rd<5>;\n"
                               "\tld.param.u64 %rd1, [cgpu_spin_ns];\n"
                               "\tmov.u64 %rd2, %globaltimer;\n"
                               "\tadd.u64 %rd3, %rd2, %rd1;\n"
                               "$L_spin:\n"
                               "\tmov.u64 %rd4, %globaltimer;\n"
                               "\tsetp.lt.u64 %p1, %rd4, %rd3;\n"
                               "\t@%p1 bra $L_spin;\n"
                               "\tret;\n}\n";

#endif
