# Build switches. TRELLIS_ENABLE_<X> defaults from detection; forcing an
# impossible one on is a configure error, never a silent downgrade.
include(CMakeDependentOption)

option(TRELLIS_BUILD_TESTS "Build the test suite" ON)
option(TRELLIS_BUILD_FUZZERS "Build libFuzzer targets (needs clang)" OFF)
set(TRELLIS_SANITIZE "" CACHE STRING "Sanitizer build: address (ASan+UBSan) or thread")
set_property(CACHE TRELLIS_SANITIZE PROPERTY STRINGS "" address thread)

if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE RelWithDebInfo CACHE STRING "Build type" FORCE)
endif()

find_program(TRELLIS_CCACHE ccache)
if(TRELLIS_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  set(CMAKE_C_COMPILER_LAUNCHER ${TRELLIS_CCACHE})
  set(CMAKE_CXX_COMPILER_LAUNCHER ${TRELLIS_CCACHE})
  set(CMAKE_CUDA_COMPILER_LAUNCHER ${TRELLIS_CCACHE})
endif()

# --- CUDA / NCCL: detected softly, /usr/local/cuda searched by default. ---
if(NOT DEFINED CUDAToolkit_ROOT AND EXISTS /usr/local/cuda)
  set(CUDAToolkit_ROOT /usr/local/cuda)
endif()
find_package(CUDAToolkit QUIET)
find_path(TRELLIS_NCCL_INCLUDE_DIR nccl.h
  HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME PATH_SUFFIXES include)
find_library(TRELLIS_NCCL_LIBRARY nccl
  HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME PATH_SUFFIXES lib lib64)

set(_cuda_found OFF)
if(CUDAToolkit_FOUND)
  set(_cuda_found ON)
endif()
set(_nccl_found OFF)
if(_cuda_found AND TRELLIS_NCCL_INCLUDE_DIR AND TRELLIS_NCCL_LIBRARY)
  set(_nccl_found ON)
endif()

option(TRELLIS_ENABLE_CUDA "Compile CUDA support (cuda_ipc channel, GPU tensors)" ${_cuda_found})
option(TRELLIS_ENABLE_NCCL "Compile the NCCL process-group backend" ${_nccl_found})

if(TRELLIS_ENABLE_CUDA AND NOT _cuda_found)
  message(FATAL_ERROR "TRELLIS_ENABLE_CUDA=ON but no CUDA toolkit was found "
                      "(set CUDAToolkit_ROOT to its prefix)")
endif()
if(TRELLIS_ENABLE_NCCL AND NOT TRELLIS_ENABLE_CUDA)
  message(FATAL_ERROR "TRELLIS_ENABLE_NCCL=ON needs TRELLIS_ENABLE_CUDA=ON")
endif()
if(TRELLIS_ENABLE_NCCL AND NOT _nccl_found)
  message(FATAL_ERROR "TRELLIS_ENABLE_NCCL=ON but nccl.h/libnccl were not found "
                      "(set NCCL_HOME to its prefix)")
endif()
if(TRELLIS_ENABLE_NCCL)
  add_library(trellis_nccl_imported INTERFACE IMPORTED)
  target_include_directories(trellis_nccl_imported INTERFACE ${TRELLIS_NCCL_INCLUDE_DIR})
  target_link_libraries(trellis_nccl_imported INTERFACE ${TRELLIS_NCCL_LIBRARY} CUDA::cudart)
endif()
message(STATUS "Trellis: CUDA=${TRELLIS_ENABLE_CUDA} NCCL=${TRELLIS_ENABLE_NCCL} "
               "sanitize='${TRELLIS_SANITIZE}' build=${CMAKE_BUILD_TYPE}")

# --- Sanitizers apply to everything compiled in this tree. ---
if(TRELLIS_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer
                      -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
elseif(TRELLIS_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
elseif(NOT TRELLIS_SANITIZE STREQUAL "")
  message(FATAL_ERROR "TRELLIS_SANITIZE must be empty, 'address' or 'thread', "
                      "got '${TRELLIS_SANITIZE}'")
endif()

# Clang's thread-safety analysis (docs/threads.md, "Locks"): every
# TRELLIS_GUARDED_BY / TRELLIS_REQUIRES in the tree is checked, and a
# violation is a compile error. The `tsa` preset turns it on.
option(TRELLIS_THREAD_SAFETY
  "Compile with clang's -Wthread-safety as an error (needs clang)" OFF)
if(TRELLIS_THREAD_SAFETY)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "TRELLIS_THREAD_SAFETY=ON needs clang "
                        "(CMAKE_CXX_COMPILER=clang++), not "
                        "${CMAKE_CXX_COMPILER_ID}")
  endif()
  add_compile_options(-Wthread-safety -Werror=thread-safety)
endif()

# Fuzz builds instrument every library for coverage, not only the fuzz
# target's own file: without it libFuzzer is blind inside the decoders it
# exercises (they live in the component libraries) and mutates at random.
if(TRELLIS_BUILD_FUZZERS)
  add_compile_options(-fsanitize=fuzzer-no-link)
endif()
