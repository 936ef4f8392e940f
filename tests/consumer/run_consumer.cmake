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
# As the environment variable (':'-separated): a ';' list would be split
# into separate arguments on its way to the command line.
string(REPLACE "|" ":" prefixes "${prefix}|${DEPENDENCY_PREFIXES}")
run(${CMAKE_COMMAND} -E env "CMAKE_PREFIX_PATH=${prefixes}"
    ${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${WORK_DIR}/build
    -G ${GENERATOR} "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}")
run(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
run(${WORK_DIR}/build/consumer)
run(${WORK_DIR}/build/consumer_rpc)

# Installed programs run from the prefix as they are: no LD_LIBRARY_PATH.
set(clean ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH)
run(${clean} ${prefix}/${BINDIR}/trellis-store --help)
run(${clean} ${prefix}/${BINDIR}/trellis-launch --nproc 2 --
    ${CMAKE_COMMAND} -E true)
run(${clean} ${prefix}/${LIBEXECDIR}/trellis/parameter_server
    --help)
