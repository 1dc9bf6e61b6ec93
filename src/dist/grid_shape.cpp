// A grid's shape and where a rank sits in it: arithmetic only (no communicator), so what reads a
// saved grid links it alone.
#include <algorithm>
#include <string>

#include "strata/dist/process_grid.h"

namespace strata::dist {

std::string GridShape::to_string() const {
  return "data " + std::to_string(data) + " x tensor " + std::to_string(tensor) + " x pipeline " +
         std::to_string(pipeline) +
         (expert > 1 ? ", experts over " + std::to_string(expert) : std::string());
}

int grid_rank(const GridShape& shape, const GridCoord& coord) {
  return coord.tensor + shape.tensor * (coord.data + shape.data * coord.pipeline);
}

GridCoord grid_coord(const GridShape& shape, int rank) {
  GridCoord c;
  c.tensor = rank % shape.tensor;
  c.data = rank / shape.tensor % shape.data;
  c.pipeline = rank / (shape.tensor * shape.data);
  c.expert = c.data % std::max(shape.expert, 1);
  return c;
}

}  // namespace strata::dist
