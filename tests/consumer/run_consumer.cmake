file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  message("${out}")
endfunction()

run(${CMAKE_COMMAND} --install ${TRELLIS_BUILD_DIR} --prefix ${prefix})

# The README's first program, as a reader copies it: the ```cpp block after
# the readme-example marker.
file(READ ${README} readme)
string(FIND "${readme}" "<!-- readme-example:" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md has no readme-example marker")
endif()
string(SUBSTRING "${readme}" ${at} -1 readme)
string(FIND "${readme}" "```cpp\n" open)
string(FIND "${readme}" "\n```\n" close)
if(open EQUAL -1 OR close EQUAL -1 OR close LESS open)
  message(FATAL_ERROR "README.md: no ```cpp block after the readme-example marker")
endif()
math(EXPR open "${open} + 7")
math(EXPR length "${close} - ${open} + 1")
string(SUBSTRING "${readme}" ${open} ${length} example)
file(WRITE ${WORK_DIR}/readme/train.cc "${example}")
# As the environment variable (':'-separated): a ';' list would be split
# into separate arguments on its way to the command line.
string(REPLACE "|" ":" prefixes "${prefix}|${DEPENDENCY_PREFIXES}")
run(${CMAKE_COMMAND} -E env "CMAKE_PREFIX_PATH=${prefixes}"
    ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build
    -G ${GENERATOR} "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}"
    -DREADME_EXAMPLE=${WORK_DIR}/readme/train.cc)
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
run(${WORK_DIR}/build/consumer_rpc)

# The README's program under the installed elastic-run, as the README runs
# it: it trains (rank 0 prints its loss) and every rank ends well.
execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH
    OMP_NUM_THREADS=1 ${prefix}/${BINDIR}/elastic-run --standalone
    --nproc-per-node 2 ${WORK_DIR}/build/train
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
if(NOT rc EQUAL 0 OR NOT out MATCHES "step 150 loss [0-9.]+")
  message(FATAL_ERROR "the README's program under elastic-run (${rc}):\n${out}\n${err}")
endif()
message("${out}")

# Installed programs run from the prefix as they are: no LD_LIBRARY_PATH.
set(clean ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH)
run(${clean} ${prefix}/${BINDIR}/trellis-store --help)
run(${clean} ${prefix}/${BINDIR}/trellis-launch --nproc 2 --
    ${CMAKE_COMMAND} -E true)
run(${clean} ${prefix}/${LIBEXECDIR}/trellis/parameter_server
    --help)
