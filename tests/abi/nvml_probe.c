/* Prints the NVML values and layouts cgpu relies on. Built once against
 * csrc/include/cgpu/nvml_abi.h and once against NVIDIA's nvml.h
 * (-DCGPU_USE_REAL_NVML_H); tests/abi compares the two outputs. */
#include "cgpu/nvml_abi.h"

#include <stddef.h>
#include <stdio.h>
#define P(x) printf("%s = %lld\n", #x, (long long)(x));
#define S(x) printf("%s = \"%s\"\n", #x, x);
/* Size and offset of a field: a field reordered, resized or retyped shows. */
#define F(t, f) printf("%s.%s = %zu @ %zu\n", #t, #f, sizeof(((t *)0)->f), offsetof(t, f));
int main(void){
P(NVML_API_VERSION)P(NVML_VALUE_NOT_AVAILABLE)P(NVML_INIT_FLAG_NO_GPUS)P(NVML_INIT_FLAG_NO_ATTACH)
P(NVML_DEVICE_NAME_BUFFER_SIZE)P(NVML_DEVICE_NAME_V2_BUFFER_SIZE)P(NVML_DEVICE_UUID_BUFFER_SIZE)P(NVML_DEVICE_UUID_V2_BUFFER_SIZE)
P(NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE)P(NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE)P(NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE)
P(NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE)P(NVML_NVLINK_MAX_LINKS)S(NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT)S(NVML_DEVICE_PCI_BUS_ID_FMT)
P(NVML_SUCCESS)P(NVML_ERROR_UNINITIALIZED)P(NVML_ERROR_INVALID_ARGUMENT)P(NVML_ERROR_NOT_SUPPORTED)P(NVML_ERROR_NO_PERMISSION)
P(NVML_ERROR_ALREADY_INITIALIZED)P(NVML_ERROR_NOT_FOUND)P(NVML_ERROR_INSUFFICIENT_SIZE)P(NVML_ERROR_INSUFFICIENT_POWER)
P(NVML_ERROR_DRIVER_NOT_LOADED)P(NVML_ERROR_TIMEOUT)P(NVML_ERROR_IRQ_ISSUE)P(NVML_ERROR_LIBRARY_NOT_FOUND)
P(NVML_ERROR_FUNCTION_NOT_FOUND)P(NVML_ERROR_CORRUPTED_INFOROM)P(NVML_ERROR_GPU_IS_LOST)P(NVML_ERROR_RESET_REQUIRED)
P(NVML_ERROR_OPERATING_SYSTEM)P(NVML_ERROR_LIB_RM_VERSION_MISMATCH)P(NVML_ERROR_IN_USE)P(NVML_ERROR_MEMORY)P(NVML_ERROR_NO_DATA)
P(NVML_ERROR_VGPU_ECC_NOT_SUPPORTED)P(NVML_ERROR_INSUFFICIENT_RESOURCES)P(NVML_ERROR_FREQ_NOT_SUPPORTED)
P(NVML_ERROR_ARGUMENT_VERSION_MISMATCH)P(NVML_ERROR_DEPRECATED)P(NVML_ERROR_NOT_READY)P(NVML_ERROR_GPU_NOT_FOUND)
P(NVML_ERROR_INVALID_STATE)P(NVML_ERROR_RESET_TYPE_NOT_SUPPORTED)P(NVML_ERROR_UNKNOWN)
P(NVML_FEATURE_DISABLED)P(NVML_FEATURE_ENABLED)P(NVML_TOPOLOGY_INTERNAL)P(NVML_TOPOLOGY_SINGLE)P(NVML_TOPOLOGY_MULTIPLE)
P(NVML_TOPOLOGY_HOSTBRIDGE)P(NVML_TOPOLOGY_NODE)P(NVML_TOPOLOGY_SYSTEM)
P(NVML_P2P_STATUS_OK)P(NVML_P2P_STATUS_CHIPSET_NOT_SUPPORED)P(NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED)
P(NVML_P2P_STATUS_GPU_NOT_SUPPORTED)P(NVML_P2P_STATUS_IOH_TOPOLOGY_NOT_SUPPORTED)P(NVML_P2P_STATUS_DISABLED_BY_REGKEY)
P(NVML_P2P_STATUS_NOT_SUPPORTED)P(NVML_P2P_STATUS_UNKNOWN)
P(NVML_P2P_CAPS_INDEX_READ)P(NVML_P2P_CAPS_INDEX_WRITE)P(NVML_P2P_CAPS_INDEX_NVLINK)P(NVML_P2P_CAPS_INDEX_ATOMICS)
P(NVML_P2P_CAPS_INDEX_PCI)P(NVML_P2P_CAPS_INDEX_PROP)P(NVML_P2P_CAPS_INDEX_UNKNOWN)
P(NVML_NVLINK_CAP_P2P_SUPPORTED)P(NVML_NVLINK_CAP_SYSMEM_ACCESS)P(NVML_NVLINK_CAP_P2P_ATOMICS)
P(NVML_NVLINK_CAP_SYSMEM_ATOMICS)P(NVML_NVLINK_CAP_SLI_BRIDGE)P(NVML_NVLINK_CAP_VALID)P(NVML_NVLINK_CAP_COUNT)
P(nvmlEventTypeSingleBitEccError)P(nvmlEventTypeDoubleBitEccError)P(nvmlEventTypePState)P(nvmlEventTypeXidCriticalError)
P(nvmlEventTypeClock)P(nvmlEventTypePowerSourceChange)P(nvmlEventMigConfigChange)P(nvmlEventTypeNone)
P(nvmlMemory_v2)P(nvmlProcessesUtilizationInfo_v1)
P(sizeof(nvmlReturn_t))P(sizeof(nvmlDevice_t))P(sizeof(nvmlEventSet_t))
P(sizeof(nvmlPciInfo_t))F(nvmlPciInfo_t, busIdLegacy)F(nvmlPciInfo_t, domain)F(nvmlPciInfo_t, bus)F(nvmlPciInfo_t, device)
F(nvmlPciInfo_t, pciDeviceId)F(nvmlPciInfo_t, pciSubSystemId)F(nvmlPciInfo_t, busId)
P(sizeof(nvmlMemory_t))F(nvmlMemory_t, total)F(nvmlMemory_t, free)F(nvmlMemory_t, used)
P(sizeof(nvmlMemory_v2_t))F(nvmlMemory_v2_t, version)F(nvmlMemory_v2_t, total)F(nvmlMemory_v2_t, reserved)
F(nvmlMemory_v2_t, free)F(nvmlMemory_v2_t, used)
P(sizeof(nvmlUtilization_t))F(nvmlUtilization_t, gpu)F(nvmlUtilization_t, memory)
P(sizeof(nvmlProcessInfo_v1_t))F(nvmlProcessInfo_v1_t, pid)F(nvmlProcessInfo_v1_t, usedGpuMemory)
P(sizeof(nvmlProcessInfo_v2_t))F(nvmlProcessInfo_v2_t, pid)F(nvmlProcessInfo_v2_t, usedGpuMemory)
F(nvmlProcessInfo_v2_t, gpuInstanceId)F(nvmlProcessInfo_v2_t, computeInstanceId)
P(sizeof(nvmlProcessInfo_t))F(nvmlProcessInfo_t, pid)F(nvmlProcessInfo_t, usedGpuMemory)
F(nvmlProcessInfo_t, gpuInstanceId)F(nvmlProcessInfo_t, computeInstanceId)
P(sizeof(nvmlProcessUtilizationSample_t))F(nvmlProcessUtilizationSample_t, pid)F(nvmlProcessUtilizationSample_t, timeStamp)
F(nvmlProcessUtilizationSample_t, smUtil)F(nvmlProcessUtilizationSample_t, memUtil)F(nvmlProcessUtilizationSample_t, encUtil)
F(nvmlProcessUtilizationSample_t, decUtil)
P(sizeof(nvmlProcessUtilizationInfo_v1_t))F(nvmlProcessUtilizationInfo_v1_t, timeStamp)F(nvmlProcessUtilizationInfo_v1_t, pid)
F(nvmlProcessUtilizationInfo_v1_t, smUtil)F(nvmlProcessUtilizationInfo_v1_t, memUtil)F(nvmlProcessUtilizationInfo_v1_t, encUtil)
F(nvmlProcessUtilizationInfo_v1_t, decUtil)F(nvmlProcessUtilizationInfo_v1_t, jpgUtil)F(nvmlProcessUtilizationInfo_v1_t, ofaUtil)
P(sizeof(nvmlProcessesUtilizationInfo_t))F(nvmlProcessesUtilizationInfo_t, version)
F(nvmlProcessesUtilizationInfo_t, processSamplesCount)F(nvmlProcessesUtilizationInfo_t, lastSeenTimeStamp)
F(nvmlProcessesUtilizationInfo_t, procUtilArray)
P(sizeof(nvmlDeviceAttributes_t))F(nvmlDeviceAttributes_t, multiprocessorCount)F(nvmlDeviceAttributes_t, sharedCopyEngineCount)
F(nvmlDeviceAttributes_t, sharedDecoderCount)F(nvmlDeviceAttributes_t, sharedEncoderCount)F(nvmlDeviceAttributes_t, sharedJpegCount)
F(nvmlDeviceAttributes_t, sharedOfaCount)F(nvmlDeviceAttributes_t, gpuInstanceSliceCount)
F(nvmlDeviceAttributes_t, computeInstanceSliceCount)F(nvmlDeviceAttributes_t, memorySizeMB)
P(sizeof(nvmlEventData_t))F(nvmlEventData_t, device)F(nvmlEventData_t, eventType)F(nvmlEventData_t, eventData)
F(nvmlEventData_t, gpuInstanceId)F(nvmlEventData_t, computeInstanceId)
return 0;}
