#pragma once

// Kept so that code written against the first layout still builds: the
// basic channel's factory now lives in basic/factory.h, beside the other
// backends'.

#include <trellis/transport/basic/factory.h>
