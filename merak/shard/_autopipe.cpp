// AutoPipe stage search, compiled. Mirrors merak/shard/autopipe.py step by
// step: the same loops, the same tie-breaking and the same double operations
// in the same order (additions, comparisons and max only, so no fused
// multiply-add can change a result), hence identical boundaries and times.
// Inputs are validated in Python; the checks here only keep bad calls from
// reading out of bounds.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <stdexcept>
#include <utility>
#include <vector>

namespace {

double simulate(const std::vector<double>& stage_forward, const std::vector<double>& stage_backward,
                int num_microbatches) {
    const int num_stages = static_cast<int>(stage_forward.size());
    const int m_count = num_microbatches;
    // Per stage: min(S - s, M) forwards, then backward/forward pairs, then the
    // remaining backwards. An op is (is_backward, microbatch).
    std::vector<std::vector<std::pair<bool, int>>> orders(num_stages);
    for (int stage = 0; stage < num_stages; ++stage) {
        const int warmup = std::min(num_stages - stage, m_count);
        auto& order = orders[stage];
        for (int m = 0; m < warmup; ++m) order.emplace_back(false, m);
        for (int m = 0; m < m_count; ++m) {
            order.emplace_back(true, m);
            if (warmup + m < m_count) order.emplace_back(false, warmup + m);
        }
    }
    std::vector<std::vector<double>> forward_end(num_stages, std::vector<double>(m_count, -1.0));
    std::vector<std::vector<double>> backward_end(num_stages, std::vector<double>(m_count, -1.0));
    std::vector<size_t> next_op(num_stages, 0);
    std::vector<double> stage_free(num_stages, 0.0);
    long long remaining = 2LL * num_stages * m_count;
    while (remaining > 0) {
        bool progressed = false;
        for (int stage = 0; stage < num_stages; ++stage) {
            const auto& order = orders[stage];
            while (next_op[stage] < order.size()) {
                const bool is_backward = order[next_op[stage]].first;
                const int m = order[next_op[stage]].second;
                double ready;
                if (is_backward) {
                    ready = stage == num_stages - 1 ? forward_end[stage][m] : backward_end[stage + 1][m];
                } else {
                    ready = stage == 0 ? 0.0 : forward_end[stage - 1][m];
                }
                if (ready < 0.0) break;
                const double start = std::max(ready, stage_free[stage]);
                if (is_backward) {
                    stage_free[stage] = start + stage_backward[stage];
                    backward_end[stage][m] = stage_free[stage];
                } else {
                    stage_free[stage] = start + stage_forward[stage];
                    forward_end[stage][m] = stage_free[stage];
                }
                ++next_op[stage];
                --remaining;
                progressed = true;
            }
        }
        if (!progressed) throw std::runtime_error("1F1B simulation deadlocked");
    }
    return *std::max_element(stage_free.begin(), stage_free.end());
}

std::vector<double> stage_sums(const std::vector<double>& costs, const std::vector<int>& boundaries) {
    std::vector<double> sums;
    for (size_t part = 0; part + 1 < boundaries.size(); ++part) {
        double total = 0.0;
        for (int index = boundaries[part]; index < boundaries[part + 1]; ++index) total += costs[index];
        sums.push_back(total);
    }
    return sums;
}

std::vector<int> min_max_start(const std::vector<double>& costs, int num_parts) {
    const int num_items = static_cast<int>(costs.size());
    const std::vector<double> reversed_costs(costs.rbegin(), costs.rend());
    std::vector<double> candidates;
    candidates.reserve(static_cast<size_t>(num_items) * (num_items + 1) / 2);
    for (int start = 0; start < num_items; ++start) {
        double total = 0.0;
        for (int index = start; index < num_items; ++index) {
            total += reversed_costs[index];
            candidates.push_back(total);
        }
    }
    std::sort(candidates.begin(), candidates.end());
    candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());

    auto parts_needed = [&](double bottleneck) {
        int parts = 1;
        double load = 0.0;
        for (double cost : reversed_costs) {
            if (cost > bottleneck) return num_items + 1;
            if (load + cost > bottleneck) {
                parts += 1;
                load = 0.0 + cost;
            } else {
                load += cost;
            }
        }
        return parts;
    };

    size_t low = 0, high = candidates.size() - 1;
    while (low < high) {
        const size_t middle = (low + high) / 2;
        if (parts_needed(candidates[middle]) <= num_parts) {
            high = middle;
        } else {
            low = middle + 1;
        }
    }
    const double bottleneck = candidates[low];
    std::vector<int> mirrored{0};
    for (int part = 0; part < num_parts - 1; ++part) {
        int end = mirrored.back();
        double load = 0.0;
        const int last_end = num_items - (num_parts - 1 - part);
        while (end < last_end && (end == mirrored.back() || load + reversed_costs[end] <= bottleneck)) {
            load += reversed_costs[end];
            ++end;
        }
        mirrored.push_back(end);
    }
    mirrored.push_back(num_items);
    std::vector<int> boundaries;
    for (auto it = mirrored.rbegin(); it != mirrored.rend(); ++it) boundaries.push_back(num_items - *it);
    return boundaries;
}

double score(const std::vector<double>& forward, const std::vector<double>& backward,
             const std::vector<int>& boundaries, int num_microbatches) {
    return simulate(stage_sums(forward, boundaries), stage_sums(backward, boundaries), num_microbatches);
}

void check_costs(const std::vector<double>& forward, const std::vector<double>& backward) {
    if (forward.size() != backward.size()) {
        throw std::invalid_argument("forward and backward costs differ in length");
    }
    for (size_t i = 0; i < forward.size(); ++i) {
        if (!(forward[i] >= 0.0) || !(backward[i] >= 0.0)) {
            throw std::invalid_argument("costs must be non-negative numbers");
        }
    }
}

std::vector<int> autopipe_boundaries(const std::vector<double>& forward, const std::vector<double>& backward,
                                     int num_parts, int num_microbatches) {
    check_costs(forward, backward);
    const int num_items = static_cast<int>(forward.size());
    if (num_parts < 1 || num_items < num_parts) {
        throw std::invalid_argument("need 1 <= num_parts <= number of shards");
    }
    if (num_microbatches < 1) throw std::invalid_argument("num_microbatches must be at least 1");
    std::vector<double> combined(num_items);
    for (int i = 0; i < num_items; ++i) combined[i] = forward[i] + backward[i];
    std::vector<int> boundaries = min_max_start(combined, num_parts);
    double best = score(forward, backward, boundaries, num_microbatches);
    const long long max_moves = static_cast<long long>(num_items) * num_parts;
    for (long long move = 0; move < max_moves; ++move) {
        const std::vector<double> stage_forward = stage_sums(forward, boundaries);
        const std::vector<double> stage_backward = stage_sums(backward, boundaries);
        int critical = 0;
        for (int stage = 1; stage < num_parts; ++stage) {
            if (stage_forward[stage] + stage_backward[stage] >
                stage_forward[critical] + stage_backward[critical]) {
                critical = stage;
            }
        }
        if (boundaries[critical + 1] - boundaries[critical] < 2) break;
        std::vector<std::vector<int>> candidates;
        if (critical > 0) {
            std::vector<int> moved = boundaries;
            moved[critical] += 1;
            candidates.push_back(std::move(moved));
        }
        if (critical < num_parts - 1) {
            std::vector<int> moved = boundaries;
            moved[critical + 1] -= 1;
            candidates.push_back(std::move(moved));
        }
        int improved = -1;
        for (size_t i = 0; i < candidates.size(); ++i) {
            const double time = score(forward, backward, candidates[i], num_microbatches);
            if (time < best) {
                best = time;
                improved = static_cast<int>(i);
            }
        }
        if (improved < 0) break;
        boundaries = candidates[improved];
    }
    return boundaries;
}

double simulate_1f1b(const std::vector<double>& stage_forward, const std::vector<double>& stage_backward,
                     int num_microbatches) {
    check_costs(stage_forward, stage_backward);
    if (stage_forward.empty()) throw std::invalid_argument("need at least one stage");
    if (num_microbatches < 1) throw std::invalid_argument("num_microbatches must be at least 1");
    return simulate(stage_forward, stage_backward, num_microbatches);
}

}  // namespace

PYBIND11_MODULE(_autopipe, m) {
    m.doc() = "Compiled AutoPipe stage search; see merak/shard/autopipe.py.";
    m.def("autopipe_boundaries", &autopipe_boundaries, pybind11::arg("forward_costs"),
          pybind11::arg("backward_costs"), pybind11::arg("num_parts"), pybind11::arg("num_microbatches"),
          "Stage boundaries from the AutoPipe search (same result as the Python version).");
    m.def("simulate_1f1b", &simulate_1f1b, pybind11::arg("stage_forward"), pybind11::arg("stage_backward"),
          pybind11::arg("num_microbatches"), "Simulated time of one 1F1B iteration.");
}
