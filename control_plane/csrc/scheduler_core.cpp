// SchedulerCore: construction, requests in and out, one decode iteration (finish, rebalance, grow, admit, commit).
// Every decision mirrors control_plane/reference.py; comments name the reference function each part ports.
#include <algorithm>
#include <chrono>
#include <climits>

#include "scheduler.h"

namespace nanocp::sched {
namespace {

const char* const kPolicyNames[] = {"nanocp", "least-batch", "least-cache", "round-robin", "uniform-cp", "medha", "csps"};
constexpr int kNumPolicies = 7;
constexpr int64_t kCspsDefaultPartition = 65536;  // CSPS's partition length without TP

std::string to_string_i128(__int128 v) {
  if (v == 0) return "0";
  const bool negative = v < 0;
  unsigned __int128 u = negative ? -(unsigned __int128)v : (unsigned __int128)v;
  std::string digits;
  while (u) {
    digits.push_back(char('0' + int(u % 10)));
    u /= 10;
  }
  if (negative) digits.push_back('-');
  return std::string(digits.rbegin(), digits.rend());
}

std::string tuple_repr(const std::vector<int64_t>& v) {  // Python's repr of a tuple of ints
  std::string s = "(";
  for (size_t k = 0; k < v.size(); ++k) s += (k ? ", " : "") + std::to_string(v[k]);
  return s + (v.size() == 1 ? ",)" : ")");
}

// reference.py parse_policy; policy_repr is Python's repr(policy) for the messages. Returns the policy, its
// argument (INT64_MAX if it has more than 18 digits) and the argument as written without leading zeros.
struct ParsedPolicy {
  Policy policy;
  int64_t arg;
  std::string arg_text;
};

ParsedPolicy parse_policy(const std::string& policy, const std::string& policy_repr) {
  const size_t colon = policy.find(':');
  const std::string name = policy.substr(0, colon);
  const std::string arg = colon == std::string::npos ? "" : policy.substr(colon + 1);
  int found = -1;
  for (int k = 0; k < kNumPolicies; ++k)
    if (name == kPolicyNames[k]) found = k;
  if (found < 0)
    throw SchedulerError("unknown policy " + policy_repr +
                         "; choose one of nanocp, least-batch, least-cache, round-robin, uniform-cp:K, medha:N, "
                         "csps[:S]");
  if (found == kUniformCP || found == kMedha || (found == kCsps && !arg.empty())) {
    const bool digits = !arg.empty() && std::all_of(arg.begin(), arg.end(), [](char c) { return c >= '0' && c <= '9'; });
    const size_t first = digits ? arg.find_first_not_of('0') : std::string::npos;
    if (!digits || first == std::string::npos) {
      const char* example = found == kUniformCP ? "uniform-cp:4" : found == kMedha ? "medha:65536" : "csps:65536";
      throw SchedulerError("policy " + policy_repr + " needs a positive integer argument, e.g. " + example);
    }
    const std::string significant = arg.substr(first);
    return {Policy(found), significant.size() > 18 ? INT64_MAX : std::stoll(significant), significant};
  }
  if (!arg.empty())
    throw SchedulerError("policy '" + name + "' takes no argument, got " + policy_repr);
  const int64_t value = found == kCsps ? kCspsDefaultPartition : 0;
  return {Policy(found), value, std::to_string(value)};
}

}  // namespace

SchedulerCore::SchedulerCore(int64_t num_nodes, int64_t instances_per_node, int64_t kv_capacity_tokens,
                             int64_t page_size, const std::string& policy, const std::string& policy_repr,
                             const std::vector<int64_t>& cp_max_lens, const std::vector<int64_t>& cp_cps,
                             int64_t max_batch_per_instance)
    : pages_(0, 0) {
  // spec.py ClusterSpec.__post_init__
  const std::pair<const char*, int64_t> fields[] = {{"num_nodes", num_nodes},
                                                    {"instances_per_node", instances_per_node},
                                                    {"kv_capacity_tokens", kv_capacity_tokens},
                                                    {"page_size", page_size}};
  for (const auto& [name, value] : fields)
    if (value <= 0)
      throw SchedulerError(std::string("ClusterSpec.") + name + " must be a positive int, got " + std::to_string(value));
  if (kv_capacity_tokens < page_size)
    throw SchedulerError("ClusterSpec.kv_capacity_tokens (" + std::to_string(kv_capacity_tokens) +
                         ") is smaller than one page (" + std::to_string(page_size) + " tokens)");
  const __int128 instances = (__int128)num_nodes * instances_per_node;
  const int64_t frames = kv_capacity_tokens / page_size;
  if (instances > (1 << 20) || (__int128)frames * instances >= ((__int128)1 << 31))
    throw SchedulerError("ClusterSpec is too large: page ids must fit in int32");
  if ((__int128)frames * page_size * instances >= ((__int128)1 << 62))
    throw SchedulerError("ClusterSpec is too large: the cluster's KV tokens must fit in 62 bits");
  shape_ = {int(num_nodes), int(instances_per_node), int(instances), page_size, int32_t(frames)};

  // reference.py ReferenceCore.__init__
  const ParsedPolicy parsed = parse_policy(policy, policy_repr);
  policy_ = parsed.policy;
  policy_arg_ = parsed.arg;
  if (policy_ == kUniformCP && instances_per_node % policy_arg_ != 0)
    throw SchedulerError("uniform-cp:" + parsed.arg_text + " needs a group size dividing instances_per_node (" +
                         std::to_string(instances_per_node) + ")");
  room_ = int64_t(frames) * page_size - 1;  // tokens an instance can take besides one new token
  wide_tokens_ = int64_t(frames) * page_size > INT32_MAX;
  if (policy_ == kMedha && policy_arg_ > room_)
    throw SchedulerError("medha:" + parsed.arg_text + ": a KV group must fit one instance (" + std::to_string(room_) +
                         " tokens plus the new one)");
  if (max_batch_per_instance < 0)
    throw SchedulerError("max_batch_per_instance must be >= 0 (0 = unbounded), got " +
                         std::to_string(max_batch_per_instance));
  // cp_buckets.py CPBucketTable.__post_init__
  if (cp_max_lens.empty() || cp_max_lens.size() != cp_cps.size())
    throw SchedulerError("CPBucketTable needs as many max_lens as cps, and at least one bucket");
  for (size_t k = 1; k < cp_max_lens.size(); ++k)
    if (cp_max_lens[k] <= cp_max_lens[k - 1])
      throw SchedulerError("CPBucketTable.max_lens must be strictly increasing: " + tuple_repr(cp_max_lens));
  for (int64_t c : cp_cps)
    if (c < 1) throw SchedulerError("CPBucketTable.cps must be >= 1: " + tuple_repr(cp_cps));
  cp_max_lens_ = cp_max_lens;
  cp_cps_ = cp_cps;
  max_batch_ = max_batch_per_instance;

  // reference.py max_context: one slot per instance stays free for the new token
  if (policy_ == kNanoCP || policy_ == kCsps)
    max_context_ = instances_per_node * room_;
  else if (policy_ == kUniformCP)
    max_context_ = policy_arg_ * room_;
  else if (policy_ == kMedha)
    max_context_ = instances * policy_arg_ - 1;
  else
    max_context_ = room_;
  group_tokens_ = policy_ == kMedha ? policy_arg_ : INT64_MAX;
  // A tail page is full within page_size steps of its last growth: that many calendar buckets (at most 4096; a
  // bucket may then hold later clocks too) name every pending page event.
  calendar_ = group_tokens_ == INT64_MAX;
  if (calendar_) {
    page_due_.buckets.resize(size_t(std::min<int64_t>(page_size, 4096)));
    budget_due_.buckets.resize(kBudgetBuckets);
  }

  const int n = shape_.num_instances;
  pages_ = PageTable(n, shape_.frames_per_instance);
  kv_tokens_.assign(n, 0);
  moe_batch_.assign(n, 0);
  num_shards_.assign(n, 0);
  remote_out_.assign(n, 0);
  node_batch_.assign(shape_.num_nodes, 0);
  slots_.assign(n, SlotAllocator());
  pending_updates_.assign(n, 0);
  lowered_seq_.assign(n, -1);
  node_order_.resize(shape_.num_nodes);
  multi_count_.assign(n + 2, 0);
}

// ------------------------------------------------------------------ requests in and out

int32_t SchedulerCore::slot_of(int64_t handle) const {
  return slot_of_handle_.find(handle);
}

const Request& SchedulerCore::request(int64_t handle) {
  const int32_t slot = slot_of(handle);
  if (slot < 0) throw UnknownHandle{handle};
  if (reqs_[slot].status == kRunning) sync(batch_pos(reqs_[slot]));
  return reqs_[slot];
}

int32_t SchedulerCore::new_slot() {
  if (!free_slots_.empty()) {
    const int32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  reqs_.emplace_back();
  return int32_t(reqs_.size() - 1);
}

void SchedulerCore::delete_request(int32_t slot) {
  Request& r = reqs_[slot];
  slot_of_handle_.erase(r.handle);
  r.status = kFree;
  r.uid = -1;
  free_slots_.push_back(slot);
}

void SchedulerCore::add_request(int64_t handle, int64_t prompt_len, int64_t max_new_tokens) {
  const std::string who = "request " + std::to_string(handle);
  if (slot_of(handle) >= 0) throw SchedulerError(who + " already exists");
  if (prompt_len < 1 || max_new_tokens < 1)
    throw SchedulerError(who + ": prompt_len and max_new_tokens must be >= 1");
  const __int128 longest = (__int128)prompt_len + max_new_tokens - 1;
  const int64_t cluster = int64_t(shape_.num_instances) * shape_.frames_per_instance * shape_.page_size;
  if (longest > cluster)
    throw SchedulerError(who + " needs " + to_string_i128(longest) + " tokens of KV, the whole cluster holds " +
                         std::to_string(cluster));
  if (prompt_len > max_context_)
    throw SchedulerError(who + ": prompt of " + std::to_string(prompt_len) +
                         " tokens can never be admitted under policy " + kPolicyNames[policy_] + " (at most " +
                         std::to_string(max_context_) + ")");
  const int32_t slot = new_slot();
  Request& r = reqs_[slot];
  r.handle = handle;
  r.prompt_len = prompt_len;
  r.max_new_tokens = max_new_tokens;
  r.decode_base = 0;
  r.status = kWaiting;
  r.admit_seq = -1;
  r.moe = r.moe_shard = -1;
  r.nshards = 0;
  r.preempted_at = -1;
  r.uid = uid_counter_++;
  slot_of_handle_.insert(handle, slot);
  waiting_.push_back({slot, r.uid});
  ++num_waiting_;
  if (max_new_tokens == 1) ++waiting_single_token_;
}

void SchedulerCore::finish(int64_t handle) {
  const int32_t slot = slot_of(handle);
  if (slot < 0) throw SchedulerError("unknown request " + std::to_string(handle));
  finish_slot(slot);
}

// reference.py finish: running -> pages freed; waiting -> leaves the queue (its entry goes stale).
void SchedulerCore::finish_slot(int32_t slot) {
  Request& r = reqs_[slot];
  if (r.status == kRunning) {
    sync(batch_pos(r));
    release(r);
    remove_running(slot);
  } else {
    --num_waiting_;
    if (r.max_new_tokens == 1) --waiting_single_token_;
  }
  finished_pending_.push_back(r.handle);
  delete_request(slot);
  // Keep the queue from filling with stale entries when requests are cancelled while they wait.
  if (int64_t(waiting_.size()) > 2 * num_waiting_ + 64) {
    size_t keep = 0;
    for (const Ref& e : waiting_)
      if (reqs_[e.slot].uid == e.uid) waiting_[keep++] = e;
    waiting_.resize(keep);
  }
}

void SchedulerCore::sync(size_t pos) {
  const BatchRec& b = rec_[pos];
  Request& r = reqs_[running_[pos]];
  r.shard(r.moe_shard).tokens = rec_tokens(b);
  r.window = rec_window(b);
}

void SchedulerCore::refresh_rec(size_t pos) {
  const Request& r = reqs_[running_[pos]];
  fill_rec(rec_[pos], r);
  if (r.nshards >= 2) refresh_multi(r, multi_entry(r));
}

SchedulerCore::MultiRec& SchedulerCore::multi_entry(const Request& r) {
  auto at = std::lower_bound(multi_.begin(), multi_.end(), r.admit_seq,
                             [](const MultiRec& e, int64_t seq) { return e.admit_seq < seq; });
  if (at == multi_.end() || at->admit_seq != r.admit_seq) throw InvariantError("multi-shard request not listed");
  return *at;
}

void SchedulerCore::refresh_multi(const Request& r, MultiRec& e) const {
  e.nshards = r.nshards;
  e.moe = r.moe;
  e.moe_shard = r.moe_shard;
  e.other_tokens = 0;
  for (int32_t k = 0; k < r.nshards; ++k) {
    const Shard& s = r.shard(k);
    if (k != r.moe_shard) e.other_tokens += s.tokens;
    // tokens of a shard fit int32 unless wide_tokens_ (then lowering reads the request)
    if (k < kMultiInline) e.shards[k] = {s.instance, s.slot, int32_t(s.tokens), s.frames.size()};
  }
}

// A request leaves the batch: the last entry is popped, any other becomes a hole.
void SchedulerCore::remove_running(int32_t slot) {
  const size_t pos = batch_pos(reqs_[slot]);
  if (pos + 1 == running_.size()) {
    running_.pop_back();
    rec_.pop_back();
    rec_due_.pop_back();
    while (!running_.empty() && running_.back() < 0) {  // never end in a hole: back() is the newest request
      running_.pop_back();
      rec_.pop_back();
      rec_due_.pop_back();
      --running_dead_;
    }
  } else {
    running_[pos] = -1;
    rec_[pos].set_lower_fast(kLowerHole);  // lowering skips it
    ++running_dead_;
  }
}

void SchedulerCore::compact_running(bool force) {
  if (!running_dead_ || (!force && running_dead_ * 8 < int64_t(running_.size()))) return;  // holes are skipped
  size_t keep = 0;
  for (size_t k = 0; k < running_.size(); ++k) {
    if (running_[k] < 0) continue;
    if (keep != k) reqs_[running_[k]].pos = int32_t(keep);
    running_[keep] = running_[k];
    rec_due_[keep] = rec_due_[k];
    rec_[keep++] = rec_[k];
  }
  running_.resize(keep);
  rec_.resize(keep);
  rec_due_.resize(keep);
  running_dead_ = 0;
  ++compactions_;
}

std::vector<int64_t> SchedulerCore::batch_handles() {
  std::vector<int64_t> out;
  out.reserve(running_.size() - size_t(running_dead_));
  for (int32_t slot : running_)
    if (slot >= 0) out.push_back(reqs_[slot].handle);
  return out;
}

// ------------------------------------------------------------------ one iteration

void SchedulerCore::step(int64_t num_steps) {
  if (num_steps < 1 || num_steps > INT32_MAX)
    throw SchedulerError("num_steps must be between 1 and " + std::to_string(INT32_MAX) + ", got " +
                         std::to_string(num_steps));
  const auto t0 = std::chrono::steady_clock::now();
  num_steps_ = num_steps;
  ++iteration_;
  last_admitted_.clear();
  last_preempted_.clear();
  last_rejected_.clear();
  preempted_slots_.clear();
  finish_completed();
  last_finished_.swap(finished_pending_);
  finished_pending_.clear();
  compact_running();
  if (policy_ == kNanoCP) rebalance_moe();
  due_.clear();
  grow_all();
  admit_waiting();
  assign_slots();
  steps_done_ += num_steps_;  // every request in the batch counts its window (the last one may be cut short)
  last_step_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
}

// reference.py _finish_completed: running requests out of decode budget (batch order), then waiting requests that
// need no decode iteration (queue order).
void SchedulerCore::finish_completed() {
  for (const Ref& e : due_) prefetch_lines(e.slot);  // the misses overlap
  for (const Ref& e : due_) {  // release reads the frames back to front
    const FrameList& frames = reqs_[e.slot].first.frames;
    if (!frames.empty()) prefetch_line(frames.data() + frames.size() - 1);
  }
  for (size_t i = 0; i < due_.size(); ++i) {
    const Ref& e = due_[i];
    const Request& r = reqs_[e.slot];
    if (r.uid == e.uid && r.status == kRunning && decode_steps(r) >= r.max_new_tokens - 1) finish_slot(e.slot);
  }
  due_.clear();
  if (!waiting_single_token_) return;
  single_token_.clear();
  for (const Ref& e : waiting_) {
    const Request& r = reqs_[e.slot];
    if (r.uid == e.uid && r.status == kWaiting && r.max_new_tokens == 1) single_token_.push_back(e.slot);
  }
  for (int32_t slot : single_token_) finish_slot(slot);
}

// reference.py _rebalance_moe: multi-shard requests, fewest shards first (stable in batch order), each to the
// instance of its KV binding with the fewest MoE requests (ties: stay, then lowest id). Reads the dense entries;
// a request is touched only when it moves.
void SchedulerCore::rebalance_moe() {
  if (multi_.empty()) return;
  int32_t widest = 0;
  for (const MultiRec& e : multi_) widest = std::max(widest, e.nshards);
  // stable counting sort by shard count
  std::fill(multi_count_.begin(), multi_count_.begin() + widest + 2, 0);
  for (const MultiRec& e : multi_) ++multi_count_[e.nshards + 1];
  for (int32_t c = 1; c <= widest + 1; ++c) multi_count_[c] += multi_count_[c - 1];
  multi_order_.resize(multi_.size());
  for (size_t i = 0; i < multi_.size(); ++i) multi_order_[multi_count_[multi_[i].nshards]++] = int32_t(i);

  // An instance's key orders (MoE requests, not the current one, id); the minimum wins (branch-free scan).
  auto key = [&](int i, int old) {
    return (uint64_t(moe_batch_[i] - (i == old)) << 32) | (uint64_t(i != old) << 31) | uint64_t(i);
  };
  for (int32_t idx : multi_order_) {
    MultiRec& e = multi_[idx];
    const int old = e.moe;
    uint64_t best_key = key(old, old);
    int32_t best_shard = e.moe_shard;
    for (int32_t k = 0; k < e.nshards; ++k) {
      const uint64_t kk = key(multi_instance(e, k), old);
      best_shard = kk < best_key ? k : best_shard;
      best_key = std::min(best_key, kk);
    }
    const int best = int(best_key & 0x7FFFFFFF);
    if (best == old) continue;
    Request& r = reqs_[e.slot];
    const size_t pos = batch_pos(r);
    sync(pos);  // the old tail's tokens back into its shard before the tail moves
    unbind_moe(r);
    bind_moe(r, best);
    r.moe_shard = best_shard;
    fill_rec(rec_[pos], r);
    refresh_multi(r, e);
    track(pos);
  }
}

// reference.py _has_room: the free tail of the request's shard on `instance` plus its free pages hold n tokens.
bool SchedulerCore::has_room(const Request& r, int instance, int64_t n) const {
  int64_t tail = 0;
  for (int32_t k = 0; k < r.nshards; ++k)
    if (r.shard(k).instance == instance) tail = r.shard(k).tail_room(shape_.page_size);
  return tail + int64_t(pages_.free_frames(instance)) * shape_.page_size >= n;
}

// reference.py _growth_target: the MoE instance, else the least-KV member of the binding, of the node, of the
// cluster that has room for the n tokens and an open batch; -1 if none. Medha: a tail group that would pass N tokens
// moves to a fresh instance.
int SchedulerCore::growth_target(const Request& r, int64_t n) const {
  int best = -1;
  auto better = [&](int i) { return best < 0 || std::make_pair(kv_tokens_[i], i) < std::make_pair(kv_tokens_[best], best); };
  const int first = (r.moe / shape_.instances_per_node) * shape_.instances_per_node;
  if (r.shard(r.moe_shard).tokens + n > group_tokens_) {
    // Medha: a full tail group opens a new instance (not yet in the binding), on the node first.
    auto fresh = [&](int i) {
      if (!better(i) || int64_t(pages_.free_frames(i)) * shape_.page_size < n || !batch_open(i)) return;
      for (int32_t k = 0; k < r.nshards; ++k)
        if (r.shard(k).instance == i) return;
      best = i;
    };
    for (int i = first; i < first + shape_.instances_per_node; ++i) fresh(i);
    if (best >= 0) return best;
    for (int i = 0; i < shape_.num_instances; ++i) fresh(i);
    return best;
  }
  if (has_room(r, r.moe, n)) return r.moe;
  auto consider = [&](int i) {
    if (better(i) && has_room(r, i, n) && batch_open(i)) best = i;
  };
  for (int32_t k = 0; k < r.nshards; ++k) consider(r.shard(k).instance);
  if (best >= 0) return best;
  for (int i = first; i < first + shape_.instances_per_node; ++i) consider(i);
  if (best >= 0) return best;
  for (int i = 0; i < shape_.num_instances; ++i) consider(i);
  return best;
}

// Every running request reserves its window (num_steps tokens, fewer when its decode budget ends sooner) on its
// MoE instance (reference.py step's growth loop + _grow). Most requests only need room in their tail page: the growth
// clock covers them. The requests with an event (a page to add, the budget running out) are visited in batch order,
// like the reference's loop; when they might not all fit their MoE instances (growth elsewhere or preemption reads
// loads mid-pass), or under medha, every request is visited instead. Requests out of decode budget after this
// iteration are noted for the next step's finish pass.
void SchedulerCore::grow_all() {
  const int64_t done = steps_done_, steps = num_steps_;
  grow_iter_ = iteration_;
  grow_steps_ = int32_t(steps);
  if (calendar_) {
    collect_events(done, done + steps);
    if (events_fit(done, steps)) return grow_events(done, steps);
  }
  grow_scan(done, steps);
}

void SchedulerCore::track(size_t pos) {
  if (!calendar_) return;
  page_due_.push(full_at(rec_[pos]), entry(pos));
}

void SchedulerCore::track_budget(size_t pos) {
  if (!calendar_) return;
  budget_due_.push(rec_due_[pos], entry(pos));
}

// Without a compaction since the entry was made, its position still names its batch entry (a request that left
// makes a hole or is popped; one appended there later may reuse its slot: then the event is a harmless extra visit,
// the growth of a visited request is the same). After one, the request itself gives its position.
int64_t SchedulerCore::locate(const Entry& e) const {
  if (e.epoch == compactions_)
    return size_t(e.pos) < running_.size() && running_[size_t(e.pos)] == e.slot ? e.pos : -1;
  const Request& r = reqs_[e.slot];
  return r.uid == e.uid && r.status == kRunning ? r.pos : -1;
}

// The running requests whose tail page fills or whose decode budget ends by steps_after, into events_ in batch
// order (stale calendar entries, of requests that finished, moved or were re-admitted since, are dropped).
void SchedulerCore::collect_events(int64_t done, int64_t steps_after) {
  events_.clear();
  auto add = [&](int64_t pos) {
    const int32_t slot = running_[size_t(pos)];
    events_.push_back({int32_t(pos), slot});
    prefetch_lines(slot);  // the visit reads the request: start the misses now, all of them overlap
  };
  // Tail pages full before steps_after; budgets ending in (done, steps_after]. A stale entry (its request finished,
  // moved or was re-admitted since; or, for a budget, was already past due when made: its request is in due_ and
  // finishes first) is dropped.
  page_due_.drain(done, steps_after, [&](const Calendar::Item& e) {
    const int64_t pos = locate(e.who);
    if (pos >= 0 && full_at(rec_[size_t(pos)]) == e.at) add(pos);
  });
  budget_due_.drain(done + 1, steps_after + 1, [&](const Calendar::Item& e) {
    const int64_t pos = locate(e.who);
    if (pos >= 0 && rec_due_[size_t(pos)] == e.at) add(pos);
  });
  std::sort(events_.begin(), events_.end());
  events_.erase(std::unique(events_.begin(), events_.end()), events_.end());
}

// Whether every event's new pages fit its MoE instance's free frames (then no event takes the slow path).
bool SchedulerCore::events_fit(int64_t done, int64_t steps) {
  const int64_t page = shape_.page_size;
  event_pages_.assign(size_t(shape_.num_instances), 0);
  for (const Event& e : events_) {
    const BatchRec& b = rec_[size_t(e.pos)];
    const int64_t left = rec_due_[size_t(e.pos)] - done;
    const int64_t w = left < steps ? std::max<int64_t>(left, 1) : steps;
    const int64_t after = b.tokens_off() + growth_clock_ + w;
    if (after > int64_t(b.blocks) * page) event_pages_[size_t(b.moe)] += ceil_div(after, page) - b.blocks;
  }
  for (int i = 0; i < shape_.num_instances; ++i)
    if (event_pages_[size_t(i)] > pages_.free_frames(i)) return false;
  return true;
}

// Calendar path: the clock moves (every record grows by num_steps, every instance's KV by num_steps per request bound
// to it), then each event's record is put back to its tokens before growth and grown like in the plain pass.
void SchedulerCore::grow_events(int64_t done, int64_t steps) {
  growth_clock_ = done + steps;
  for (int i = 0; i < shape_.num_instances; ++i) kv_tokens_[size_t(i)] += steps * moe_batch_[size_t(i)];
  for (size_t e = 0; e < events_.size(); ++e) {
    if (e + 4 < events_.size()) prefetch_line(reqs_[events_[e + 4].slot].first.frames.end());  // its new frame
    const size_t pos = size_t(events_[e].pos);
    BatchRec& b = rec_[pos];
    const int64_t before = full_at(b);
    b.set_tokens_off(b.tokens_off() - steps);
    kv_tokens_[size_t(b.moe)] -= steps;
    grow_one(pos, done, steps);  // fits (events_fit): no preemption, the batch keeps its shape
    if (full_at(b) != before) track(pos);
  }
}

// The plain pass over the batch in batch order, the clock held at `done` (records not yet visited read as before
// growth, the visited ones as after it), then moved: every record's offset follows it.
void SchedulerCore::grow_scan(int64_t done, int64_t steps) {
  scan_tracked_.clear();
  size_t n = running_.size();
  const int64_t page = shape_.page_size;
  for (size_t k = 0; k < n; ++k) {
    if (k + kFar < n) {  // the line of a request likely to need a page or to finish
      const BatchRec& ahead = rec_[k + kFar];
      if (ahead.tokens_off() + done + steps > ahead.blocks * page || done + steps >= rec_due_[k + kFar])
        prefetch_request(k);
    }
    if (running_[k] < 0) continue;  // a hole left by a finished request
    const int64_t before = full_at(rec_[k]);
    const bool kept = grow_one(k, done, steps);
    n = running_.size();  // preemption pops requests from the back of the batch
    // the offsets move by -steps after the pass: an unchanged page-full clock reads `before - steps` here
    if (kept && full_at(rec_[k]) + steps != before) scan_tracked_.push_back(int32_t(k));
  }
  growth_clock_ = done + steps;
  for (BatchRec& b : rec_) b.set_tokens_off(b.tokens_off() - steps);
  for (int32_t pos : scan_tracked_)
    if (size_t(pos) < running_.size() && running_[size_t(pos)] >= 0) track(size_t(pos));
}

// One request's growth (the reference's loop body): a window of num_steps tokens (fewer when its decode budget ends
// sooner) in its tail page, else a new page or another instance (grow_request). False if it preempted itself.
bool SchedulerCore::grow_one(size_t k, int64_t done, int64_t steps) {
  BatchRec& b = rec_[k];
  const int64_t due_at = rec_due_[k], left = due_at - done;  // decode steps the request has left
  const int64_t w = left < steps ? std::max<int64_t>(left, 1) : steps;
  const int64_t after = rec_tokens(b) + w;
  if (after <= int64_t(b.blocks) * shape_.page_size && after <= group_tokens_) {
    b.set_window(int32_t(w));
    b.set_tokens_off(after - growth_clock_);
    b.window_at = int32_t(grow_iter_);
    kv_tokens_[size_t(b.moe)] += w;
  } else if (!grow_request(k, w)) {
    return false;
  }
  if (done + steps >= due_at) due_.push_back({running_[k], reqs_[running_[k]].uid});
  return true;
}

// The growth of one request whose tail page is full (or, medha, whose tail group is): a new page on its MoE
// instance, else another target (grow_slow). False if the request preempted itself.
bool SchedulerCore::grow_request(size_t pos, int64_t n) {
  const int32_t slot = running_[pos];
  sync(pos);
  Request& r = reqs_[slot];
  Shard& s = r.shard(r.moe_shard);
  const int64_t page = shape_.page_size;
  if (s.tokens + n <= group_tokens_ && s.tail_room(page) + int64_t(pages_.free_frames(r.moe)) * page >= n)
    add_tokens(s, n);
  else if (!grow_slow(slot, n))
    return false;
  r.window = int32_t(n);
  refresh_rec(pos);
  return true;
}

// reference.py _grow when the MoE instance is full: find another target, preempting the most recently admitted
// request until one exists; returns false if `slot` itself was preempted.
bool SchedulerCore::grow_slow(int32_t slot, int64_t n) {
  Request& r = reqs_[slot];
  int target;
  while ((target = growth_target(r, n)) < 0) {
    const int32_t victim = running_.back();  // the most recently admitted (the batch never ends in a hole)
    preempt(victim);
    if (victim == slot) return false;
  }
  if (target != r.moe) {
    unbind_moe(r);
    bind_moe(r, target);
  }
  int32_t idx = -1;
  for (int32_t k = 0; k < r.nshards; ++k)
    if (r.shard(k).instance == target) idx = k;
  if (idx < 0) {
    add_shard(r, target);
    idx = r.nshards - 1;
  }
  r.moe_shard = idx;
  add_tokens(r.shard(idx), n);
  return true;
}

void SchedulerCore::add_tokens(Shard& s, int64_t n) {  // reference.py _add_tokens
  const int64_t page = shape_.page_size;
  const int64_t need = ceil_div(s.tokens + n, page) - ceil_div(s.tokens, page);
  pages_.alloc(s.instance, need, s.frames);
  pending_updates_[s.instance] += need;
  s.tokens += n;
  kv_tokens_[s.instance] += n;
}

// Append an empty shard on `instance` to the binding (reusing a retired Shard's capacity).
void SchedulerCore::add_shard(Request& r, int instance) {
  if (r.nshards > 0 && size_t(r.nshards) > r.spill.size()) r.spill.emplace_back();
  Shard& s = r.shard(r.nshards++);
  s.instance = instance;
  s.tokens = 0;
  s.slot = -1;
  s.emitted = 0;
  unslotted_.push_back({{int32_t(&r - reqs_.data()), r.uid}, r.nshards - 1});
  num_shards_[instance] += 1;
  if (r.moe >= 0) remote_out_[r.moe] += 1;
  if (r.status == kRunning && r.nshards == 2) {  // its entry's contents follow with its record (refresh_rec)
    MultiRec e{};
    e.admit_seq = r.admit_seq;
    e.slot = int32_t(&r - reqs_.data());
    auto pos = std::lower_bound(multi_.begin(), multi_.end(), e,
                                [](const MultiRec& a, const MultiRec& b) { return a.admit_seq < b.admit_seq; });
    multi_.insert(pos, e);
  }
}

void SchedulerCore::bind_moe(Request& r, int instance) {
  r.moe = instance;
  moe_batch_[instance] += 1;
  node_batch_[instance / shape_.instances_per_node] += 1;
  remote_out_[instance] += r.nshards - 1;
}

void SchedulerCore::unbind_moe(Request& r) {
  moe_batch_[r.moe] -= 1;
  node_batch_[r.moe / shape_.instances_per_node] -= 1;
  remote_out_[r.moe] -= r.nshards - 1;
  r.moe = -1;
}

void SchedulerCore::release(Request& r) {  // reference.py _release
  if (r.nshards >= 2) multi_.erase(multi_.begin() + (&multi_entry(r) - multi_.data()));
  for (int32_t k = 0; k < r.nshards; ++k) {
    Shard& s = r.shard(k);
    pages_.free(s.instance, s.frames);
    if (s.slot >= 0) slots_[s.instance].release(s.slot);
    pending_updates_[s.instance] -= s.frames.size() - s.emitted;
    kv_tokens_[s.instance] -= s.tokens;
    num_shards_[s.instance] -= 1;
  }
  unbind_moe(r);
  for (int32_t k = 0; k < r.nshards; ++k) r.shard(k).frames.clear_and_trim(kKeptFrames);
  r.nshards = 0;
  r.moe_shard = -1;
}

void SchedulerCore::preempt(int32_t slot) {  // reference.py _preempt (the queue front is rebuilt at admission)
  Request& r = reqs_[slot];
  const int64_t steps = decode_steps(r);
  sync(batch_pos(r));
  release(r);
  remove_running(slot);
  r.status = kWaiting;
  r.decode_base = steps;
  r.preempted_at = iteration_;
  ++num_waiting_;
  preempted_slots_.push_back(slot);
  last_preempted_.push_back(r.handle);
}

// reference.py _assign_slots: block-table slots for the shards this step created, after all of its releases (a
// request preempted in a step is not re-admitted in it, so a running owner means the shard is live).
void SchedulerCore::assign_slots() {
  for (const ShardRef& e : unslotted_) {
    Request& r = reqs_[e.request.slot];
    if (r.uid != e.request.uid || r.status != kRunning) continue;
    Shard& s = r.shard(e.shard);
    s.slot = slots_[s.instance].alloc();
  }
  unslotted_.clear();
}

// ------------------------------------------------------------------ admission

// reference.py _admit_waiting: queue = this step's preempted requests (most recent first) + the old queue.
void SchedulerCore::admit_waiting() {
  still_waiting_.clear();
  for (size_t k = preempted_slots_.size(); k-- > 0;) {
    const int32_t slot = preempted_slots_[k];
    admit_one(slot, still_waiting_);
  }
  for (const Ref& e : waiting_) {
    const Request& r = reqs_[e.slot];
    if (r.uid == e.uid && r.status == kWaiting) admit_one(e.slot, still_waiting_);
  }
  waiting_.swap(still_waiting_);
}

bool SchedulerCore::admit_one(int32_t slot, std::vector<Ref>& still_waiting) {
  Request& r = reqs_[slot];
  const int64_t context = r.prompt_len + r.decode_base;
  if (context > max_context_) {
    last_rejected_.push_back(r.handle);
    --num_waiting_;
    delete_request(slot);
    return false;
  }
  // A full window first; a window of one always fits an empty cluster (max_context), so nothing stalls.
  const int64_t window = window_of(r.max_new_tokens - 1 - r.decode_base);
  int moe = -1;
  if (r.preempted_at != iteration_) {
    if (place(context, window, moe)) {
      commit(slot, moe, window);
      return true;
    }
    if (window > 1 && place(context, 1, moe)) {
      commit(slot, moe, 1);
      return true;
    }
  }
  still_waiting.push_back({slot, r.uid});
  return false;
}

// reference.py _commit: shards in order [moe, rest of the split in split order]; pages allocated in that order.
void SchedulerCore::commit(int32_t slot, int moe, int64_t window) {
  Request& r = reqs_[slot];
  const int64_t steps = r.decode_base;
  const bool recompute = steps > 0;
  r.status = kRunning;  // before add_shard, which enters multi-shard requests into multi_
  r.admit_seq = admit_counter_++;
  r.moe = -1;
  r.nshards = 0;
  for (int pass = 0; pass < 2; ++pass)
    for (const auto& [i, n] : split_) {
      if ((i == moe) != (pass == 0)) continue;
      add_shard(r, i);
      add_tokens(r.shard(r.nshards - 1), n);
    }
  bind_moe(r, moe);
  r.moe_shard = 0;
  r.window = int32_t(window);
  r.decode_base = steps + window - (steps_done_ + num_steps_);  // decode_steps = steps + window after this step
  r.due_at = r.max_new_tokens - 1 - r.decode_base;
  r.pos = int32_t(running_.size());
  running_.push_back(slot);
  rec_.push_back(BatchRec{});
  rec_due_.push_back(r.due_at);
  refresh_rec(rec_.size() - 1);
  track(rec_.size() - 1);
  track_budget(rec_.size() - 1);
  --num_waiting_;
  last_admitted_.emplace_back(r.handle, r.context_len() - window, recompute);
  if (steps_done_ + num_steps_ >= r.due_at) due_.push_back({slot, r.uid});
}

}  // namespace nanocp::sched
