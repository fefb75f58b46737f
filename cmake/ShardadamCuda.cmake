# Optional CUDA. SHARDADAM_CUDA = AUTO (build kernels when nvcc is found),
# ON (require them) or OFF. Sets SHARDADAM_WITH_CUDA.
set(SHARDADAM_CUDA "AUTO" CACHE STRING "Build the CUDA kernels: AUTO, ON or OFF")
set_property(CACHE SHARDADAM_CUDA PROPERTY STRINGS AUTO ON OFF)

set(SHARDADAM_WITH_CUDA OFF)
if(NOT SHARDADAM_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  check_language(CUDA)  # never fails; CMAKE_CUDA_COMPILER is NOTFOUND without nvcc
  if(CMAKE_CUDA_COMPILER)
    # A100 and H100/H200 machine code plus PTX for newer GPUs. Without this
    # CMake takes nvcc's default (sm_75), which Hopper would only JIT.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
      set(CMAKE_CUDA_ARCHITECTURES 80 90)
    endif()
    # Static runtime: the module has no libcudart dependency and imports on
    # machines with no CUDA at all; it shares the driver's context with torch.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
    enable_language(CUDA)
    set(SHARDADAM_WITH_CUDA ON)
  elseif(SHARDADAM_CUDA STREQUAL "ON")
    message(FATAL_ERROR "SHARDADAM_CUDA=ON but no CUDA compiler was found: put nvcc on PATH "
                        "or set CMAKE_CUDA_COMPILER")
  endif()
endif()
message(STATUS "shardadam: CUDA kernels ${SHARDADAM_WITH_CUDA} (SHARDADAM_CUDA=${SHARDADAM_CUDA})")
