# shardadam._tensor_scan ([Note: the tensor scan] in python/shardadam/_addresses.py):
# built against the torch that the build's Python imports, when it imports one
# (pip install --no-build-isolation, as every documented build does). Without
# torch at build time the package takes its Python passes instead.
# SHARDADAM_TENSOR_SCAN = AUTO (build it when torch imports), ON (require it) or OFF.
set(SHARDADAM_TENSOR_SCAN "AUTO" CACHE STRING "Build the tensor scan helper: AUTO, ON or OFF")
set_property(CACHE SHARDADAM_TENSOR_SCAN PROPERTY STRINGS AUTO ON OFF)

set(SHARDADAM_WITH_TENSOR_SCAN OFF)
if(NOT SHARDADAM_TENSOR_SCAN STREQUAL "OFF")
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import os, torch; d = os.path.dirname(torch.__file__); print(torch.__version__, int(torch._C._GLIBCXX_USE_CXX11_ABI), os.path.join(d, 'include'), os.path.join(d, 'lib'), sep=';')"
    RESULT_VARIABLE torch_found OUTPUT_VARIABLE torch_info ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(torch_found EQUAL 0)
    list(GET torch_info 0 torch_version)
    list(GET torch_info 1 torch_cxx11_abi)
    list(GET torch_info 2 torch_include)
    list(GET torch_info 3 torch_lib)
    find_library(torch_c10 c10 PATHS "${torch_lib}" NO_DEFAULT_PATH REQUIRED)
    find_library(torch_python torch_python PATHS "${torch_lib}" NO_DEFAULT_PATH REQUIRED)
    Python_add_library(_tensor_scan MODULE WITH_SOABI cpp/tensor_scan/tensor_scan.cpp)
    # torch's headers need C++20 from torch 2.13 on; its warnings are not ours.
    # libc10 and libtorch_python are found beside the installed torch, or are already loaded by import torch.
    set_target_properties(_tensor_scan PROPERTIES CXX_STANDARD 20 INSTALL_RPATH "$ORIGIN/../torch/lib")
    target_include_directories(_tensor_scan SYSTEM PRIVATE "${torch_include}")
    target_compile_definitions(_tensor_scan PRIVATE _GLIBCXX_USE_CXX11_ABI=${torch_cxx11_abi}
                               SHARDADAM_TORCH_VERSION="${torch_version}")
    target_compile_options(_tensor_scan PRIVATE -O2 -Wall -Wextra)
    target_link_libraries(_tensor_scan PRIVATE "${torch_c10}" "${torch_python}")
    install(TARGETS _tensor_scan LIBRARY DESTINATION shardadam)
    set(SHARDADAM_WITH_TENSOR_SCAN ON)
  elseif(SHARDADAM_TENSOR_SCAN STREQUAL "ON")
    message(FATAL_ERROR "SHARDADAM_TENSOR_SCAN=ON but the build's Python cannot import torch: "
                        "install torch and build with pip install --no-build-isolation")
  endif()
endif()
message(STATUS "shardadam: tensor scan ${SHARDADAM_WITH_TENSOR_SCAN} (SHARDADAM_TENSOR_SCAN=${SHARDADAM_TENSOR_SCAN})")
