# Build-tree include root: <trellis/core/error.h> resolves to core/error.h.
# Installed builds get an explicit list of public headers instead (Install.cmake).
include(GNUInstallDirs)
option(BUILD_SHARED_LIBS "Build shared libraries" ON)

set(TRELLIS_BUILD_INCLUDE_DIR ${PROJECT_BINARY_DIR}/include)
file(MAKE_DIRECTORY ${TRELLIS_BUILD_INCLUDE_DIR})
if(NOT EXISTS ${TRELLIS_BUILD_INCLUDE_DIR}/trellis)
  file(CREATE_LINK ${PROJECT_SOURCE_DIR} ${TRELLIS_BUILD_INCLUDE_DIR}/trellis SYMBOLIC)
endif()

set(TRELLIS_WARNINGS -Wall -Wextra -Wpedantic -Wno-unused-parameter)

# Installed binaries and libraries find the Trellis libraries relative to
# themselves ($ORIGIN), so an install prefix works wherever it is, without
# LD_LIBRARY_PATH; dependencies outside the system's directories (a pip
# libtorch, CUDA) keep the path they were linked from.
set(CMAKE_INSTALL_RPATH_USE_LINK_PATH ON)
# The run path of a binary installed in `destination` (relative to the
# prefix).
function(trellis_install_rpath target destination)
  file(RELATIVE_PATH rel /${destination} /${CMAKE_INSTALL_LIBDIR})
  set_target_properties(${target} PROPERTIES INSTALL_RPATH "$ORIGIN/${rel}")
endfunction()
# Binaries: bin/ -> libdir. Libraries set their own below ($ORIGIN: one
# directory for all of them).
file(RELATIVE_PATH _trellis_bin_to_lib /${CMAKE_INSTALL_BINDIR}
     /${CMAKE_INSTALL_LIBDIR})
set(CMAKE_INSTALL_RPATH "$ORIGIN/${_trellis_bin_to_lib}")
set(TRELLIS_INSTALL_TARGETS "" CACHE INTERNAL "")

# trellis_component(<name> SOURCES ... PUBLIC_HEADERS ... [DEPS ...] [PRIVATE_DEPS ...])
# Creates trellis_<name> (alias trellis::<name>, exported as trellis::<name>).
function(trellis_component name)
  cmake_parse_arguments(A "" "" "SOURCES;PUBLIC_HEADERS;DEPS;PRIVATE_DEPS" ${ARGN})
  set(tgt trellis_${name})
  add_library(${tgt} ${A_SOURCES})
  add_library(trellis::${name} ALIAS ${tgt})
  set_target_properties(${tgt} PROPERTIES EXPORT_NAME ${name}
    OUTPUT_NAME trellis_${name} INSTALL_RPATH "$ORIGIN")
  target_include_directories(${tgt} PUBLIC
    $<BUILD_INTERFACE:${TRELLIS_BUILD_INCLUDE_DIR}>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_compile_options(${tgt} PRIVATE ${TRELLIS_WARNINGS})
  target_link_libraries(${tgt} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  foreach(h ${A_PUBLIC_HEADERS})
    get_filename_component(dir ${h} DIRECTORY)
    install(FILES ${h} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/trellis/${name}/${dir})
  endforeach()
  set(TRELLIS_INSTALL_TARGETS ${TRELLIS_INSTALL_TARGETS} ${tgt} CACHE INTERNAL "")
endfunction()

# trellis_test_process(<executable>): a test binary, or a process that
# tests start (a rank, a peer). Under TSan it carries the suppressions of
# tests/tsan_suppressions.cc: a helper's report ends it with TSan's exit
# code (66) and fails the test that started it just as the test's own would.
function(trellis_test_process name)
  if(TRELLIS_SANITIZE STREQUAL "thread")
    target_sources(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests/tsan_suppressions.cc)
  endif()
  target_compile_options(${name} PRIVATE ${TRELLIS_WARNINGS})
endfunction()

# trellis_test(<binary> SOURCES ... DEPS ...): one gtest binary per component.
function(trellis_test name)
  cmake_parse_arguments(A "" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${A_SOURCES})
  trellis_test_process(${name})
  target_link_libraries(${name} PRIVATE ${A_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 120)
  endif()
  if(TRELLIS_SANITIZE)
    trellis_sanitizer_tests(${name} TIMEOUT ${A_TIMEOUT} LABELS ${A_LABELS})
  else()
    gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60
      PROPERTIES TIMEOUT ${A_TIMEOUT} LABELS "${A_LABELS}")
  endif()
endfunction()

# Cases the sanitizer builds leave out of every test binary: gtest negative
# patterns, ':'-separated (the Makefile passes its list;
# docs/building.md).
set(TRELLIS_SANITIZER_GTEST_SKIP "" CACHE STRING
    "gtest patterns of cases the sanitizer test runs skip")

# The ctest entries of a test binary in a sanitizer build, written after it
# links by cmake/GtestSuites.cmake: one per gtest suite for a binary that
# loads libtorch (whose start costs ~2 s under ASan), one per case
# otherwise.
function(trellis_sanitizer_tests name)
  cmake_parse_arguments(A "" "TIMEOUT" "LABELS" ${ARGN})
  string(REPLACE ";" "," labels "${A_LABELS}")
  set(ctest_file "${CMAKE_CURRENT_BINARY_DIR}/${name}_tests.cmake")
  set(include_file "${CMAKE_CURRENT_BINARY_DIR}/${name}_include.cmake")
  add_custom_command(TARGET ${name} POST_BUILD
    BYPRODUCTS "${ctest_file}"
    COMMAND "${CMAKE_COMMAND}"
      "-DTEST_EXECUTABLE=$<TARGET_FILE:${name}>"
      "-DCTEST_FILE=${ctest_file}"
      "-DWORKING_DIR=${CMAKE_CURRENT_BINARY_DIR}"
      "-DTIMEOUT=${A_TIMEOUT}" "-DLABELS=${labels}"
      "-DSKIP=${TRELLIS_SANITIZER_GTEST_SKIP}"
      -P "${PROJECT_SOURCE_DIR}/cmake/GtestSuites.cmake"
    VERBATIM)
  file(WRITE "${include_file}"
    "if(EXISTS \"${ctest_file}\")\n  include(\"${ctest_file}\")\nendif()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${include_file}")
endfunction()
