// Everything a trainer needs: include this one header.
#ifndef COLLECTIVES_COLLECTIVES_H_
#define COLLECTIVES_COLLECTIVES_H_

#include "collectives/cluster.h"
#include "collectives/communication.h"
#include "collectives/errors.h"
#include "collectives/evaluator.h"
#include "collectives/packing.h"
#include "collectives/parameter_server.h"
#include "collectives/strategy.h"
#include "collectives/types.h"
#include "collectives/version.h"

#endif  // COLLECTIVES_COLLECTIVES_H_
