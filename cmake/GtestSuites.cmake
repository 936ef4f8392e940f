# Script mode (cmake -P), run after a test binary is linked in a sanitizer
# build (trellis_test in TrellisHelpers.cmake): writes CTEST_FILE, the
# ctest entries for TEST_EXECUTABLE.
#
# A binary that loads libtorch spends about 2 s under ASan (0.6 s without)
# in libtorch's static initialisers before its first test, so one ctest
# entry per test case paid that 250 times per sanitizer run. Such a binary
# gets one entry per gtest suite instead, named "<Suite>.*" and run with
# --gtest_filter=<Suite>.*; every other binary keeps one entry per case,
# named "<Suite>.<Case>", as gtest_discover_tests names them (and, like
# its entries, reported as skipped when the case calls GTEST_SKIP; a suite
# entry passes when its cases pass or skip).
#
# Inputs (-D): TEST_EXECUTABLE, CTEST_FILE, WORKING_DIR, TIMEOUT (seconds,
# per case), LABELS (comma-separated), SKIP (gtest negative patterns,
# ':'-separated: cases left out of every entry, e.g. "Suite.Case*").

execute_process(COMMAND "${TEST_EXECUTABLE}" --gtest_list_tests
                OUTPUT_VARIABLE listing ERROR_VARIABLE errors
                RESULT_VARIABLE rc TIMEOUT 60)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR
    "${TEST_EXECUTABLE} --gtest_list_tests failed (${rc}):\n${errors}")
endif()

execute_process(COMMAND ldd "${TEST_EXECUTABLE}" OUTPUT_VARIABLE needed
                RESULT_VARIABLE rc)
set(per_suite OFF)
if(rc EQUAL 0 AND needed MATCHES "libtorch_cpu")
  set(per_suite ON)
endif()

# gtest's negative patterns, as a CMake regex over "<Suite>.<Case>".
set(skip_regexes)
if(SKIP)
  string(REPLACE ":" ";" skip_patterns "${SKIP}")
  foreach(p IN LISTS skip_patterns)
    string(REPLACE "." "\\." r "${p}")
    string(REPLACE "*" ".*" r "${r}")
    string(REPLACE "?" "." r "${r}")
    list(APPEND skip_regexes "^${r}$")
  endforeach()
endif()

string(REPLACE "," ";" labels "${LABELS}")
string(REPLACE ";" "\\;" labels "${labels}")
set(filter_tail "")
if(SKIP)
  set(filter_tail "-${SKIP}")
endif()

# "Suite." lines start a suite ("  # TypeParam = ..." may follow), indented
# lines are its cases ("  # GetParam() = ..." may follow).
string(REPLACE "\n" ";" lines "${listing}")
set(entries "")
set(suite "")
set(count 0)
macro(flush_suite)
  if(per_suite AND NOT suite STREQUAL "" AND count GREATER 0)
    math(EXPR timeout "${TIMEOUT} * ${count}")
    if(timeout GREATER 900)
      set(timeout 900)
    endif()
    string(APPEND entries
      "add_test([==[${suite}.*]==] [==[${TEST_EXECUTABLE}]==] "
      "[==[--gtest_filter=${suite}.*${filter_tail}]==])\n"
      "set_tests_properties([==[${suite}.*]==] PROPERTIES "
      "WORKING_DIRECTORY [==[${WORKING_DIR}]==] TIMEOUT ${timeout} "
      "COST ${count} LABELS [==[${labels}]==])\n")
  endif()
endmacro()
foreach(line IN LISTS lines)
  if(line MATCHES "^([^ #][^ ]*)\\.( .*)?$")
    flush_suite()
    set(suite "${CMAKE_MATCH_1}")
    set(count 0)
  elseif(line MATCHES "^  ([^ #]+)" AND NOT suite STREQUAL "")
    set(name "${suite}.${CMAKE_MATCH_1}")
    set(skipped OFF)
    foreach(r IN LISTS skip_regexes)
      if(name MATCHES "${r}")
        set(skipped ON)
      endif()
    endforeach()
    if(NOT skipped)
      math(EXPR count "${count} + 1")
      if(NOT per_suite)
        string(APPEND entries
          "add_test([==[${name}]==] [==[${TEST_EXECUTABLE}]==] "
          "[==[--gtest_filter=${name}]==])\n"
          "set_tests_properties([==[${name}]==] PROPERTIES "
          "WORKING_DIRECTORY [==[${WORKING_DIR}]==] TIMEOUT ${TIMEOUT} "
          "LABELS [==[${labels}]==] "
          "SKIP_REGULAR_EXPRESSION [==[\\[  SKIPPED \\]]==])\n")
      endif()
    endif()
  endif()
endforeach()
flush_suite()
file(WRITE "${CTEST_FILE}" "${entries}")
