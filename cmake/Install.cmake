include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS ${TRELLIS_INSTALL_TARGETS} EXPORT TrellisTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT TrellisTargets NAMESPACE trellis::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Trellis)

configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/TrellisConfig.cmake.in
  ${PROJECT_BINARY_DIR}/TrellisConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Trellis)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/TrellisConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/TrellisConfig.cmake
              ${PROJECT_BINARY_DIR}/TrellisConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/Trellis)
