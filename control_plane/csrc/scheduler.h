// SchedulerCore: the C++ control-plane core, a step-for-step port of control_plane/reference.py (ReferenceCore).
//
// Same decisions as the reference, cheaper bookkeeping:
//  - requests live in a slot pool (flat vector), handles map to slots once per API call;
//  - decode_steps of running requests is implicit (offset + decode steps of the finished iterations);
//  - growth is implicit: a running request's tail tokens are its record's offset plus the growth clock (decode steps
//    applied so far), so a step moves the clock and the per-instance KV sums in O(instances) and visits only the
//    requests with an event: a page filling (a calendar keyed by the clock value at which the tail page is full) or
//    the decode budget running out (a second calendar keyed by due_at). A step whose events might not fit (an
//    instance short of pages: growth elsewhere, preemption) or a policy with KV groups (medha) falls back to the plain
//    pass over the batch;
//  - lowering runs over the dense per-batch records (BatchRec) and the multi-shard requests' dense binding records
//    (MultiRec), and touches a request itself only when it has frames to list or a shard without a slot yet; a batch
//    record holds a single-shard request's two rows as templates (one vector add and one store per row; holes are
//    marked in the record and skipped in the same loop);
//  - only multi-shard requests take part in MoE rebalancing, ordered by a stable counting sort over their MultiRecs;
//  - every shard keeps its frames contiguous and a count of those already lowered, so lowering writes only the
//    new block-table entries, into pooled output buffers; per-instance counters size every section up front.
#pragma once
#include <algorithm>
#include <climits>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "handle_map.h"
#include "page_table.h"

namespace nanocp::sched {

// Bad input (raised in Python as nanocp.control_plane.spec.SchedulerError, a ValueError).
struct SchedulerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A broken bookkeeping invariant (raised in Python as AssertionError, like the reference's asserts).
struct InvariantError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Unknown handle in a read-only query (raised in Python as KeyError(handle), like a dict lookup).
struct UnknownHandle {
  int64_t handle;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Fetch the cache line at p. An asm statement, not __builtin_prefetch: GCC 12 drops the builtin in some loops (a
// prefetch of &vec[vec2[k]] guarded by a test of vec2[k], as in the batch passes below).
inline void prefetch_line(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}

enum Policy : int { kNanoCP, kLeastBatch, kLeastCache, kRoundRobin, kUniformCP, kMedha, kCsps };
enum Status : int8_t { kWaiting = 0, kRunning = 1, kFree = -1 };

struct Shard {
  FrameList frames;  // [pages] frames on `instance`, in token order
  int64_t tokens = 0;
  int32_t instance = -1;
  int32_t slot = -1;    // row of the instance's block-table store (handed out at the end of the creating step)
  int32_t emitted = 0;  // frames already listed in a table lowered for `instance`
  int64_t tail_room(int64_t page) const { return int64_t(frames.size()) * page - tokens; }
};
static_assert(sizeof(Shard) == 40, "a request's first shard and its binding share one cache line");

// One request. The first cache line holds what a request's slow paths (a new page, a move, lowering its frames)
// touch: the first shard (the only one for most requests) inline, the MoE binding, the window and the point at which
// the decode budget runs out. While it runs, its tail shard's `tokens` and `window` are current only after
// SchedulerCore::sync (its batch record holds them).
struct alignas(64) Request {
  Shard first;             // shard 0 of the binding
  int32_t moe = -1;        // MoE instance (running only)
  int32_t moe_shard = -1;  // index of the shard on `moe`
  int32_t nshards = 0;     // live shards, in binding order: first, spill[0], spill[1], ...
  int32_t window = 1;      // running: decode steps of this iteration (tokens reserved on the tail shard)
  int64_t due_at = 0;      // running: out of decode budget once steps_done_ reaches it (max_new - 1 - decode_base)
  // second line
  int8_t status = kFree;
  int32_t pos = -1;  // running: index in the batch arrays (kept current by compaction)
  int64_t decode_base = 0;  // waiting: decode_steps; running: decode_steps - steps_done_ (until the last window)
  int64_t max_new_tokens = 0;
  int64_t uid = -1;  // unique per add_request; tells stale list entries apart after slot reuse
  int64_t admit_seq = -1;
  int64_t handle = 0;
  int64_t prompt_len = 0;
  int64_t preempted_at = -1;  // iteration of the last preemption
  std::vector<Shard> spill;   // shards 1.. (entries past nshards - 1 are retired and keep their capacity)

  Shard& shard(int32_t k) { return k == 0 ? first : spill[k - 1]; }
  const Shard& shard(int32_t k) const { return k == 0 ? first : spill[k - 1]; }
  int64_t context_len() const {
    int64_t total = first.tokens;
    for (int32_t k = 1; k < nshards; ++k) total += spill[k - 1].tokens;
    return nshards ? total : 0;
  }
};
static_assert(sizeof(Shard) + 4 * sizeof(int32_t) + sizeof(int64_t) == 64, "the binding must fill one line");

constexpr int32_t kLowerSingle = 1;  // one shard: lowering needs nothing but the record
constexpr int32_t kLowerMulti = 2;   // several shards: the record and the request's MultiRec
constexpr int32_t kLowerHole = 3;    // a hole in the batch (skipped; not counted in the batch index)

// A running request's growth and lowering state, in batch order (parallel to the batch). While the request runs,
// its tail shard's token count and its window live here; SchedulerCore::sync copies them into the Request.
// The first 32 bytes are the single-shard request's two routing-table rows less what only the lowering pass knows:
// the shard row is shard_row + {g - 1, 0, clock, 0} and the MoE row moe_row + {g, clock, shard index, 0} (int32
// lanes wrap: the low 32 bits of the offset plus those of the clock are the low 32 bits of the tokens), so the pass
// builds each row with one vector add. The other fields go through accessors that keep the templates current.
struct BatchRec {
  int32_t shard_row[4] = {0, -1, 0, -1};  // {lower_fast, -1, low 32 bits of tokens_off, slot}
  int32_t moe_row[4] = {0, 0, 0, 1};      // {0, low 32 bits of tokens_off - window, 0, window}
  int32_t off_hi = 0;      // high 32 bits of tokens_off
  int32_t blocks = 0;      // frames of the tail shard
  int32_t moe = -1;        // copy of Request::moe
  int32_t window_at = -1;  // low 32 bits of the iteration whose growth set the window (other iterations: that
                           // growth's num_steps)

  // tokens of the tail shard (on the MoE instance) minus the growth clock
  int64_t tokens_off() const { return int64_t(uint64_t(int64_t(off_hi)) << 32 | uint32_t(shard_row[2])); }
  int32_t window() const { return moe_row[3]; }  // decode steps of the iteration window_at
  int32_t slot() const { return shard_row[3]; }  // the tail shard's block-table slot (-1: not handed out yet)
  // kLowerSingle / kLowerMulti: every frame listed, every slot known (0: lowering reads the request; kLowerHole)
  int32_t lower_fast() const { return shard_row[0]; }

  void set_tokens_off(int64_t off) {
    shard_row[2] = int32_t(uint32_t(uint64_t(off)));
    off_hi = int32_t(off >> 32);
    moe_row[1] = int32_t(uint32_t(shard_row[2]) - uint32_t(moe_row[3]));
  }
  void set_window(int32_t window) {
    moe_row[3] = window;
    moe_row[1] = int32_t(uint32_t(shard_row[2]) - uint32_t(window));
  }
  void set_slot(int32_t slot) { shard_row[3] = slot; }
  void set_lower_fast(int32_t mode) { shard_row[0] = mode; }
};
static_assert(sizeof(BatchRec) == 48, "dense batch records");

// An int32 output buffer shared with numpy; reused once Python has dropped every view of it.
struct TableBuffer {
  std::unique_ptr<int32_t[]> data;
  size_t capacity = 0;
};

struct ClusterShape {
  int num_nodes = 0;
  int instances_per_node = 0;
  int num_instances = 0;
  int64_t page_size = 0;
  int32_t frames_per_instance = 0;
};

class SchedulerCore {
 public:
  SchedulerCore(int64_t num_nodes, int64_t instances_per_node, int64_t kv_capacity_tokens, int64_t page_size,
                const std::string& policy, const std::string& policy_repr, const std::vector<int64_t>& cp_max_lens,
                const std::vector<int64_t>& cp_cps, int64_t max_batch_per_instance);
  SchedulerCore(const SchedulerCore&) = delete;  // requests own their frame lists
  SchedulerCore& operator=(const SchedulerCore&) = delete;

  // requests in and out
  void add_request(int64_t handle, int64_t prompt_len, int64_t max_new_tokens);
  void finish(int64_t handle);
  void step(int64_t num_steps);
  int64_t max_context() const { return max_context_; }

  // views
  int64_t iteration() const { return iteration_; }
  const std::vector<std::tuple<int64_t, int64_t, bool>>& last_admitted() const { return last_admitted_; }
  const std::vector<int64_t>& last_finished() const { return last_finished_; }
  const std::vector<int64_t>& last_preempted() const { return last_preempted_; }
  const std::vector<int64_t>& last_rejected() const { return last_rejected_; }
  std::vector<int64_t> batch_handles();
  int64_t num_waiting() const { return num_waiting_; }
  int64_t free_frames(int instance) const { return pages_.free_frames(instance); }
  const std::vector<int64_t>& kv_tokens() const { return kv_tokens_; }
  const std::vector<int64_t>& moe_batch() const { return moe_batch_; }
  const std::vector<int64_t>& num_shards() const { return num_shards_; }
  const Request& request(int64_t handle);  // with its tail tokens and window current; throws UnknownHandle
  int64_t decode_steps(const Request& r) const {
    // A window cut short by the decode budget ends the request exactly at max_new_tokens - 1.
    return r.status == kRunning ? std::min(r.decode_base + steps_done_, r.max_new_tokens - 1) : r.decode_base;
  }
  int64_t num_steps() const { return num_steps_; }
  const ClusterShape& shape() const { return shape_; }

  // Lower every instance into one pooled buffer: instance i's table is data[offsets[i]:offsets[i+1]]. Block tables
  // are incremental (frames added since the instance's last table) or, with `full`, complete snapshots.
  std::shared_ptr<TableBuffer> lower_all(std::vector<size_t>& offsets, bool full);
  // Lower one instance only (full pass for the row numbering, rows written for `instance` only).
  std::shared_ptr<TableBuffer> lower(int instance, size_t& size, bool full);
  void check_invariants();

  // wall time of the last step() and of the last lower_all()/lower() inside C++ (diagnostics for benchmarks)
  int64_t last_step_ns() const { return last_step_ns_; }
  int64_t last_lower_ns() const { return last_lower_ns_; }

 private:
  struct Ref {  // a list entry naming a request; stale once the slot's uid changed
    int32_t slot;
    int64_t uid;
  };
  struct ShardRef {  // a shard created in this step, waiting for its block-table slot
    Ref request;
    int32_t shard;
  };
  // A running multi-shard request's binding, dense: rebalancing reads it instead of the request, and lowering does
  // too while every frame is listed (BatchRec::lower_fast == kLowerMulti). The tail (MoE) shard's tokens and frames
  // are the batch record's; the other shards' are here. Refreshed with the batch record (refresh_rec).
  static constexpr int32_t kMultiInline = 8;  // shards kept here; a wider binding reads its request past them
  struct MultiShard {
    int32_t instance, slot, tokens, frames;
  };
  struct MultiRec {
    int64_t admit_seq;  // batch order
    int32_t slot;       // the request's slot
    int32_t nshards, moe, moe_shard;
    int64_t other_tokens;  // tokens of every shard but the tail
    MultiShard shards[kMultiInline];
  };
  struct Entry {  // a calendar entry's request: its slot and uid, and its batch position as of compaction `epoch`
    int64_t uid;
    int64_t epoch;
    int32_t slot;
    int32_t pos;
  };
  // Requests keyed by a growth-clock value `at`, in buckets by at % the bucket count (a bucket also holds later
  // rounds: at + buckets, ...). drain(lo, hi, visit) hands every item with at in [lo, hi) to visit and drops it;
  // items of later rounds stay. Used for page-full clocks and decode-budget ends.
  struct Calendar {
    struct Item {
      int64_t at;
      Entry who;
    };
    std::vector<std::vector<Item>> buckets;

    void push(int64_t at, const Entry& who) { buckets[size_t(at) % buckets.size()].push_back({at, who}); }
    const std::vector<Item>& bucket_of(int64_t at) const { return buckets[size_t(at) % buckets.size()]; }
    template <class Visit>
    void drain(int64_t lo, int64_t hi, Visit&& visit) {
      const int64_t span = std::min<int64_t>(hi - lo, int64_t(buckets.size()));
      for (int64_t c = lo; c < lo + span; ++c) {
        std::vector<Item>& bucket = buckets[size_t(c) % buckets.size()];
        size_t keep = 0;
        for (const Item& e : bucket) {
          if (e.at < hi)
            visit(e);
          else
            bucket[keep++] = e;  // a later round of this bucket
        }
        bucket.resize(keep);
      }
    }
  };
  struct Event {  // a running request the growth pass must visit, by batch position
    int32_t pos;
    int32_t slot;
    bool operator<(const Event& o) const { return pos < o.pos; }
    bool operator==(const Event& o) const { return pos == o.pos; }
  };
  // Row counts per section follow from the incremental per-instance counters: every MoE row is a request bound here,
  // every shard row a shard held here, every update a frame not yet listed here (all used frames for a snapshot);
  // q_recv/res_send = shards held here for a request bound elsewhere; q_send/res_recv = remote shards of the requests
  // bound here. One array per field, indexed by instance: the batch pass touches only what a record needs (the
  // single-shard path reads two section pointers and the row counts, and stores the row counts back).
  struct Cursors {
    struct Rows {
      int32_t moe = 0, shards = 0;  // MoE and shard rows written so far (read as one uint64 by write_singles)
    };
    static_assert(sizeof(Rows) == sizeof(uint64_t), "the lowering pass moves both counts with one add");
    std::vector<int32_t*> header;    // [16]
    std::vector<int32_t*> moe;       // [n_moe, 4]
    std::vector<int32_t*> shards;    // [n_shards, 4]
    std::vector<int32_t*> updates;   // [n_updates, 3]
    std::vector<int32_t*> q_send;    // [n_q_send, 3]
    std::vector<int32_t*> q_recv;    // [n_q_recv, 2]
    std::vector<int32_t*> res_send;  // [n_res_send, 3]
    std::vector<int32_t*> res_recv;  // [n_res_recv, 2]
    std::vector<Rows> rows;
    std::vector<int32_t> n_updates, n_remote_in, n_remote_out, max_blocks;

    void reset(int n) {  // every pointer null (an instance not written), every count 0
      for (auto* v : {&header, &moe, &shards, &updates, &q_send, &q_recv, &res_send, &res_recv}) v->assign(n, nullptr);
      rows.assign(n, Rows{});
      for (auto* v : {&n_updates, &n_remote_in, &n_remote_out, &max_blocks}) v->assign(n, 0);
    }
  };

  // requests
  int32_t slot_of(int64_t handle) const;
  int32_t new_slot();
  void delete_request(int32_t slot);
  void compact_running(bool force = false);  // drop the holes (only once they are an eighth of the batch)
  // The plain growth pass streams the batch records and touches a request only on its slow path: its line is fetched
  // kFar records ahead when the record says the slow path is likely. (Lowering does not: the requests it reads are
  // those the step just visited, whose lines are still cached, and fetching them ahead measured slower.)
  static constexpr size_t kFar = 48;
  // A released shard keeps its frame storage up to this many frames for the next request in its slot.
  static constexpr int32_t kKeptFrames = 256;
  void prefetch_request(size_t k) const {
    if (k + kFar < running_.size() && running_[k + kFar] >= 0) prefetch_line(&reqs_[running_[k + kFar]]);
  }
  void prefetch_lines(int32_t slot) const {  // both lines of a request
    const char* at = reinterpret_cast<const char*>(&reqs_[slot]);
    prefetch_line(at);
    prefetch_line(at + 64);
  }
  void remove_running(int32_t slot);
  size_t batch_pos(const Request& r) const { return size_t(r.pos); }  // a running request's index in the batch
  void sync(size_t pos);  // batch record pos -> its request (tail tokens, window), before the request is read
  void fill_rec(BatchRec& b, const Request& r) const {  // in place: a returned record is copied through the stack
    const Shard& tail = r.shard(r.moe_shard);
    b.set_window(r.window);
    b.set_tokens_off(tail.tokens - growth_clock_);
    b.blocks = tail.frames.size();
    b.moe = r.moe;
    b.set_slot(tail.slot);
    b.window_at = int32_t(grow_iter_);
    bool listed = true;  // every frame listed, every slot known
    for (int32_t k = 0; k < r.nshards; ++k) {
      const Shard& s = r.shard(k);
      listed &= s.emitted == s.frames.size() && s.slot >= 0;
    }
    const bool dense = r.nshards <= kMultiInline && !wide_tokens_;  // its MultiRec has every shard
    b.set_lower_fast(!listed ? 0 : r.nshards == 1 ? kLowerSingle : dense ? kLowerMulti : 0);
  }
  void refresh_rec(size_t pos);  // the record of batch entry pos (and its multi-shard entry) from its request
  MultiRec& multi_entry(const Request& r);  // a running multi-shard request's entry in multi_
  void refresh_multi(const Request& r, MultiRec& e) const;
  int32_t multi_instance(const MultiRec& e, int32_t k) const {
    return k < kMultiInline ? e.shards[k].instance : reqs_[e.slot].shard(k).instance;
  }
  int64_t rec_tokens(const BatchRec& b) const { return b.tokens_off() + growth_clock_; }
  int32_t rec_window(const BatchRec& b) const { return b.window_at == int32_t(grow_iter_) ? b.window() : grow_steps_; }
  // growth calendar (policies without KV groups)
  int64_t full_at(const BatchRec& b) const { return int64_t(b.blocks) * shape_.page_size - b.tokens_off(); }
  void track(size_t pos);  // enter the record's page-full clock (and, with `budget`, its due_at) in the calendars
  void track_budget(size_t pos);
  Entry entry(size_t pos) const { return {reqs_[running_[pos]].uid, compactions_, running_[pos], int32_t(pos)}; }
  int64_t locate(const Entry& e) const;  // the entry's batch position now, -1 if it left the batch
  void collect_events(int64_t done, int64_t steps_after);
  bool events_fit(int64_t done, int64_t steps);

  // one iteration
  void finish_completed();
  void finish_slot(int32_t slot);
  void rebalance_moe();
  void grow_all();
  void grow_events(int64_t done, int64_t steps);
  void grow_scan(int64_t done, int64_t steps);
  bool grow_one(size_t k, int64_t done, int64_t steps);  // false: the batch shrank under it (preemption)
  bool grow_request(size_t pos, int64_t n);
  bool grow_slow(int32_t slot, int64_t n);
  int growth_target(const Request& r, int64_t n) const;
  bool has_room(const Request& r, int instance, int64_t n) const;
  void preempt(int32_t slot);
  void release(Request& r);
  void add_tokens(Shard& s, int64_t n);
  void add_shard(Request& r, int instance);
  void bind_moe(Request& r, int instance);
  void unbind_moe(Request& r);
  void admit_waiting();
  void assign_slots();
  bool admit_one(int32_t slot, std::vector<Ref>& still_waiting);
  int64_t window_of(int64_t steps_left) const { return std::max<int64_t>(1, std::min(num_steps_, steps_left)); }

  // placement (fills split_ with (instance, tokens) in split order, `window` new tokens on the MoE instance)
  bool place(int64_t context, int64_t window, int& moe);
  bool place_single(int64_t context, int64_t window, int& moe);
  bool place_nanocp(int64_t context, int64_t window, int& moe);
  bool place_uniform(int64_t context, int64_t window, int& moe);
  bool place_medha(int64_t context, int64_t window, int& moe);
  bool place_csps(int64_t context, int64_t window, int& moe);
  bool can_allocate(int moe) const;
  bool batch_open(int instance) const { return !max_batch_ || moe_batch_[instance] < max_batch_; }
  int64_t cp_lookup(int64_t length) const;
  void commit(int32_t slot, int moe, int64_t window);

  // lowering
  int64_t table_updates(int instance, bool full) const;
  size_t table_size(int instance, bool full) const;
  void start_table(int instance, int32_t* base, size_t total, bool full, Cursors& cursors) const;
  template <bool kAll, bool kFull>
  void write_tables(Cursors& cursors, int only);
  template <bool kAll>
  size_t write_singles(size_t k, int32_t& g, Cursors& cursors, int only);
  template <bool kAll, bool kFull>
  void write_request(size_t k, int32_t g, Cursors& cursors, int only);
  template <bool kAll>
  void write_multi(const BatchRec& b, const MultiRec& e, int32_t g, Cursors& cursors, int only);
  template <bool kAll>
  int32_t write_shard(Cursors& cursors, int moe, int32_t moe_row, int instance, int32_t g, int32_t tokens,
                      int32_t slot, int only);
  void finish_tables(Cursors& cursors, int only);
  std::shared_ptr<TableBuffer> pooled_buffer(size_t size);

  ClusterShape shape_;
  Policy policy_ = kNanoCP;
  int64_t policy_arg_ = 0;
  std::vector<int64_t> cp_max_lens_, cp_cps_;
  int64_t max_batch_ = 0;
  int64_t max_context_ = 0;
  int64_t room_ = 0;                   // tokens an instance can take besides one new token
  bool wide_tokens_ = false;           // one instance can hold more than INT32_MAX tokens (lowering checks shards)
  int64_t group_tokens_ = INT64_MAX;  // medha: tokens per KV group (a full tail group moves growth elsewhere)

  PageTable pages_;
  std::vector<int64_t> kv_tokens_;   // [instances] KV tokens held
  std::vector<int64_t> moe_batch_;   // [instances] requests whose MoE binding is here
  std::vector<int64_t> num_shards_;  // [instances] shards held
  std::vector<int64_t> remote_out_;  // [instances] remote shards of the requests whose MoE binding is here
  std::vector<int64_t> node_batch_;  // [nodes] requests owned by the node's instances
  std::vector<SlotAllocator> slots_;  // [instances] block-table store slots
  std::vector<int64_t> pending_updates_;  // [instances] frames of live shards not yet listed in a table
  std::vector<int64_t> lowered_seq_;  // [instances] iteration of the last table lowered for it (-1: none)

  std::vector<Request> reqs_;  // slot pool
  std::vector<int32_t> free_slots_;
  HandleMap slot_of_handle_;
  std::vector<int32_t> running_;      // slots in batch (= admission) order; -1 = removed (a hole, compacted lazily;
                                      // never last)
  std::vector<BatchRec> rec_;         // the record of each running_ entry
  std::vector<int64_t> rec_due_;      // Request::due_at of each running_ entry (growth reads it, lowering does not)
  int64_t running_dead_ = 0;
  int64_t compactions_ = 0;  // compactions so far: batch positions hold between two
  std::vector<Ref> waiting_;  // queue order; stale entries are skipped and dropped at admission
  int64_t num_waiting_ = 0;
  int64_t waiting_single_token_ = 0;  // waiting requests with max_new_tokens == 1
  std::vector<Ref> due_;              // running requests whose decode budget ends before the next step
  std::vector<MultiRec> multi_;       // running requests with >= 2 shards, in batch order
  std::vector<ShardRef> unslotted_;   // shards created in this step, in creation order
  std::vector<int32_t> preempted_slots_;
  std::vector<int32_t> single_token_;

  int64_t iteration_ = -1;
  int64_t num_steps_ = 1;   // decode steps of the current iteration
  int64_t steps_done_ = 0;  // decode steps of the completed step() calls, summed
  int64_t growth_clock_ = 0;  // decode steps whose growth the records hold (steps_done_, + num_steps_ after growth)
  int64_t grow_iter_ = -1;    // iteration of the last growth pass
  int32_t grow_steps_ = 1;    // its num_steps: the window of every record it did not visit

  // growth calendars (empty under medha): page_due_ holds the requests whose tail page fills at a clock value,
  // budget_due_ those whose decode budget ends at one
  static constexpr size_t kBudgetBuckets = 4096;
  bool calendar_ = false;
  Calendar page_due_;
  Calendar budget_due_;
  std::vector<Event> events_;
  std::vector<int32_t> scan_tracked_;  // positions whose page-full clock changed in a fallback pass
  int64_t rr_cursor_ = 0;
  int64_t admit_counter_ = 0;
  int64_t uid_counter_ = 0;
  std::vector<int64_t> finished_pending_;
  std::vector<std::tuple<int64_t, int64_t, bool>> last_admitted_;
  std::vector<int64_t> last_finished_, last_preempted_, last_rejected_;

  // scratch (no per-step allocation)
  std::vector<std::pair<int32_t, int64_t>> split_;  // (instance, tokens) in split order
  std::vector<int32_t> members_, order_;
  std::vector<int64_t> loads_, fill_;
  std::vector<int64_t> event_pages_;  // [instances] pages this step's events need
  std::vector<int32_t> node_order_;
  std::vector<Ref> still_waiting_;
  std::vector<int32_t> multi_order_;  // multi_ indices, fewest shards first
  std::vector<int64_t> multi_count_;
  std::vector<std::shared_ptr<TableBuffer>> pool_;
  Cursors cursors_;  // lowering's write state (reused)

  int64_t last_step_ns_ = 0, last_lower_ns_ = 0;
};

}  // namespace nanocp::sched
