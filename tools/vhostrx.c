// SPDX-License-Identifier: GPL-2.0
/*
 * vhostrx - a user-space "guest" for vhost-net's receive direction.
 *
 * vhost-net pulls packets that the host transmits on a tap straight from
 * tun's ring (in batches of up to 64, into a private buffer) and copies them
 * into receive buffers a guest posted on virtqueue 0.  This program plays the
 * guest: it owns a /dev/vhost-net instance, lays out the RX virtqueue and the
 * receive buffers in its own memory (one memory region, guest physical
 * address == user address), gives vhost the tap as backend, and then reaps,
 * classifies and re-posts buffers.  No VM is involved.
 *
 * usage: vhostrx (--fd N | --dev NAME | --tap NAME) [--flags HEX] [--bp]
 *                [--vnet-hdr] [--ring N] [--bufs N] [--buf-size B]
 *                [--rate PPS | --delay-us N] [--burst N] [--paused]
 *                [--detached] [--cpu C]
 *
 *   --fd N         an inherited, attached tun/tap fd (the test keeps its own
 *                  copy); its flags (IFF_TAP, IFF_VNET_HDR) come from TUNGETIFF
 *   --dev/--tap NAME  attach with TUNSETIFF; flags default IFF_TAP|IFF_NO_PI
 *                  (--flags replaces them; --bp adds IFF_BACKPRESSURE 0x0080,
 *                  --vnet-hdr adds IFF_VNET_HDR)
 *   --vnet-hdr     with --fd: require the fd to have IFF_VNET_HDR
 *   --ring N       virtqueue size (power of 2, default 256)
 *   --bufs N       receive buffers kept posted (default: ring size)
 *   --buf-size B   bytes per receive buffer (default 2048)
 *   --rate PPS     reap at most PPS packets per second (a slow guest), in
 *                  bursts of up to --burst packets (default 8; a token
 *                  bucket, so one wake-up and one kick per burst)
 *   --delay-us N   the same as --rate 1000000/N
 *   --paused       set everything up but post no buffer and reap nothing
 *                  until "go".  vhost still runs once when the first packet
 *                  arrives and moves up to 64 packets from tun's ring into its
 *                  private buffer (that is how vhost-net works without guest
 *                  buffers); use --detached too to keep the ring untouched.
 *   --detached     do not set the backend until "attach" (or "go")
 *
 * Virtio-net header: VIRTIO_F_VERSION_1 is negotiated, so the header is
 * 12 bytes.  If the tap has IFF_VNET_HDR, the tap writes it (we set
 * TUNSETVNETHDRSZ 12 on the fd); otherwise vhost writes it
 * (VHOST_NET_F_VIRTIO_NET_HDR).  Mergeable buffers are not negotiated: one
 * buffer per packet, so --buf-size must hold 12 + the frame.
 *
 * Control: one command per line on stdin, answers are JSON lines on stdout
 * (the same protocol as tunreader, so the test library drives both alike).
 *   go | pause     resume / stop reaping.  The first "go" posts the buffers
 *                  (and sets the backend if --detached and never attached).
 *                  While paused, vhost keeps filling buffers already posted.
 *   stat           print the counters
 *   wait KEY N MS  answer once counter KEY >= N ("result":"ok"), or once MS ms
 *                  passed without reaping a packet ("result":"stall").
 *                  KEY: pkts ours pktgen idK
 *   detach         VHOST_NET_SET_BACKEND fd -1 for the RX queue: vhost gives
 *                  the packets in its private buffer back to tun's ring
 *                  (ptr_ring_unconsume)
 *   attach         VHOST_NET_SET_BACKEND with the tap fd again
 *   quit (or EOF)  print the counters and exit
 *
 * Counters: pkts/bytes (buffers vhost filled; bytes without the virtio-net
 * header), ours (UDP with udpburst's "NDRP" header; per sender id in
 * "per_id"), pktgen, other, bad (lengths that do not match what vhost
 * reported), dups (a sequence number of an id seen twice), reorder (a
 * sequence number lower than one already seen for that id), missing (per id:
 * highest sequence seen + 1 - distinct sequences seen), kicks, calls
 * (reads of the call eventfd), signals (the signals vhost-net sent through
 * it, summed from those reads: one per flush of its used ring, at the end
 * of every handle_rx run that filled a buffer and after every batch of
 * more than 64 buffers within one), attaches, detaches, errors (failed ioctls).  "ebadfd" and "read_errors"
 * exist for tunreader compatibility and stay 0.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <linux/vhost.h>
#include <linux/virtio_config.h>
#include <linux/virtio_net.h>
#include <linux/virtio_ring.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "pktclass.h"

#ifndef IFF_BACKPRESSURE
#define IFF_BACKPRESSURE 0x0080
#endif

#define MAX_SEQ (1u << 20)	/* sequence numbers tracked per id */
#define HDR_LEN sizeof(struct virtio_net_hdr_mrg_rxbuf)	/* VERSION_1 */
#define REAP_BATCH 64
#define PAGE 4096ul

struct counters {
	unsigned long long pkts, bytes, ours, pktgen, other, bad;
	unsigned long long dups, reorder, kicks, calls, signals;
	unsigned long long attaches, detaches, errors;
	unsigned long long per_id[MAX_IDS];
	unsigned long long distinct[MAX_IDS];
	long long max_seq[MAX_IDS];
};

static struct counters cnt;
static uint8_t *seen[MAX_IDS];	/* bitmap of sequence numbers per id */

/* device state */
static int vhost_fd = -1, tap_fd = -1, kick_fd = -1, call_fd = -1;
static struct vring vr;
static unsigned int ring_num = 256, nbufs, buf_size = 2048;
static uint8_t *bufs_mem;
static uint16_t avail_idx, last_used;
static int running = 1, attached, posted, is_tap;

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what)
{
	fprintf(stderr, "vhostrx: %s: %s\n", what, strerror(errno));
	exit(2);
}

static unsigned long long missing(int id)
{
	if (cnt.max_seq[id] < 0)
		return 0;
	return (unsigned long long)(cnt.max_seq[id] + 1) - cnt.distinct[id];
}

static void print_list(const char *name, unsigned long long (*get)(int))
{
	int i;

	printf(",\"%s\":[", name);
	for (i = 0; i < MAX_IDS; i++)
		printf("%s%llu", i ? "," : "", get(i));
	printf("]");
}

static unsigned long long per_id(int i)
{
	return cnt.per_id[i];
}

static void print_counters(const char *event, const char *result)
{
	printf("{\"event\":\"%s\"", event);
	if (result)
		printf(",\"result\":\"%s\"", result);
	printf(",\"running\":%s,\"attached\":%s,\"posted\":%s,\"pkts\":%llu,"
	       "\"bytes\":%llu,\"ours\":%llu,\"pktgen\":%llu,\"other\":%llu,"
	       "\"bad\":%llu,\"ebadfd\":0,\"read_errors\":0,\"dups\":%llu,"
	       "\"reorder\":%llu,\"kicks\":%llu,\"calls\":%llu,\"signals\":%llu,"
	       "\"attaches\":%llu,\"detaches\":%llu,\"errors\":%llu",
	       running ? "true" : "false", attached ? "true" : "false",
	       posted ? "true" : "false", cnt.pkts, cnt.bytes, cnt.ours,
	       cnt.pktgen, cnt.other, cnt.bad, cnt.dups, cnt.reorder,
	       cnt.kicks, cnt.calls, cnt.signals, cnt.attaches, cnt.detaches, cnt.errors);
	print_list("per_id", per_id);
	print_list("missing", missing);
	printf("}\n");
	fflush(stdout);
}

static void print_error(const char *cmd, int err)
{
	printf("{\"event\":\"error\",\"cmd\":\"%s\",\"errno\":%d,\"error\":\"%s\"}\n",
	       cmd, err, strerror(err));
	fflush(stdout);
}

static unsigned long long counter(const char *key)
{
	if (!strcmp(key, "pkts"))
		return cnt.pkts;
	if (!strcmp(key, "ours"))
		return cnt.ours;
	if (!strcmp(key, "pktgen"))
		return cnt.pktgen;
	if (!strncmp(key, "id", 2)) {
		int id = atoi(key + 2);

		if (id >= 0 && id < MAX_IDS)
			return cnt.per_id[id];
	}
	return 0;
}

static void note_seq(uint32_t id, uint32_t seq)
{
	cnt.per_id[id]++;
	if (seq >= MAX_SEQ)
		return;
	if (seen[id][seq / 8] & (1u << (seq % 8))) {
		cnt.dups++;
		return;
	}
	seen[id][seq / 8] |= (uint8_t)(1u << (seq % 8));
	cnt.distinct[id]++;
	if ((long long)seq < cnt.max_seq[id])
		cnt.reorder++;
	else
		cnt.max_seq[id] = seq;
}

/* p: the frame after the virtio-net header, len: its length */
static void classify(const unsigned char *p, size_t len)
{
	uint32_t id = 0, seq = 0;

	switch (pkt_classify(p, len, is_tap, &id, &seq)) {
	case PKT_OURS:
		cnt.ours++;
		if (id < MAX_IDS)
			note_seq(id, seq);
		break;
	case PKT_PKTGEN:
		cnt.pktgen++;
		break;
	case PKT_OTHER:
		cnt.other++;
		break;
	default:
		cnt.bad++;
	}
}

/* --- virtqueue ------------------------------------------------------------ */
static void kick_if_needed(void)
{
	uint64_t one = 1;

	/* our avail->idx store before vhost's used->flags store is read;
	 * pairs with the barrier in vhost_enable_notify() */
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (__atomic_load_n(&vr.used->flags, __ATOMIC_RELAXED) &
	    VRING_USED_F_NO_NOTIFY)
		return;
	if (write(kick_fd, &one, sizeof(one)) != sizeof(one))
		die("kick");
	cnt.kicks++;
}

static void add_avail(uint16_t id)
{
	vr.avail->ring[avail_idx % ring_num] = id;
	avail_idx++;
}

static void publish_avail(void)
{
	__atomic_store_n(&vr.avail->idx, avail_idx, __ATOMIC_RELEASE);
	kick_if_needed();
}

static void post_all(void)
{
	unsigned int i;

	for (i = 0; i < nbufs; i++)
		add_avail((uint16_t)i);
	posted = 1;
	publish_avail();
}

static int used_pending(void)
{
	return __atomic_load_n(&vr.used->idx, __ATOMIC_ACQUIRE) != last_used;
}

/* reap one used buffer, classify it, give it back */
static void reap_one(void)
{
	struct vring_used_elem *e = &vr.used->ring[last_used % ring_num];
	uint32_t id = e->id, len = e->len;

	last_used++;
	cnt.pkts++;
	if (id >= nbufs || len < HDR_LEN || len > buf_size) {
		cnt.bad++;
	} else {
		const unsigned char *b = bufs_mem + (size_t)id * buf_size;

		cnt.bytes += len - HDR_LEN;
		classify(b + HDR_LEN, len - HDR_LEN);
	}
	if (id < nbufs)
		add_avail((uint16_t)id);
}

/* token bucket in ns of budget: --rate/--delay-us with bursts of --burst */
static void refill(uint64_t *credit, uint64_t *last, uint64_t cap, uint64_t now)
{
	if (now > *last) {
		*credit += now - *last;
		if (*credit > cap)
			*credit = cap;
	}
	*last = now;
}

static int set_backend(int fd)
{
	struct vhost_vring_file b = { .index = 0, .fd = fd };

	if (ioctl(vhost_fd, VHOST_NET_SET_BACKEND, &b))
		return -errno;
	return 0;
}

static void setup_vhost(int vnet_sock)
{
	uint64_t features, want = 0;
	size_t ring_bytes, total;
	struct vhost_memory *mem;
	struct vhost_vring_state st;
	struct vhost_vring_addr addr;
	struct vhost_vring_file f;
	void *base;
	unsigned int i;

	vhost_fd = open("/dev/vhost-net", O_RDWR);
	if (vhost_fd < 0)
		die("/dev/vhost-net");
	if (ioctl(vhost_fd, VHOST_SET_OWNER, NULL))
		die("VHOST_SET_OWNER");
	if (ioctl(vhost_fd, VHOST_GET_FEATURES, &features))
		die("VHOST_GET_FEATURES");
	if (!(features & (1ull << VIRTIO_F_VERSION_1))) {
		fprintf(stderr, "vhostrx: vhost-net lacks VIRTIO_F_VERSION_1\n");
		exit(2);
	}
	want |= 1ull << VIRTIO_F_VERSION_1;
	if (!vnet_sock)
		want |= 1ull << VHOST_NET_F_VIRTIO_NET_HDR;
	if (ioctl(vhost_fd, VHOST_SET_FEATURES, &want))
		die("VHOST_SET_FEATURES");

	/* one region: vring, then the receive buffers */
	ring_bytes = (vring_size(ring_num, PAGE) + PAGE - 1) & ~(PAGE - 1);
	total = ring_bytes + (size_t)nbufs * buf_size;
	base = mmap(NULL, total, PROT_READ | PROT_WRITE,
		    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	if (base == MAP_FAILED)
		die("mmap");
	vring_init(&vr, ring_num, base, PAGE);
	bufs_mem = (uint8_t *)base + ring_bytes;
	for (i = 0; i < nbufs; i++) {
		vr.desc[i].addr = (uint64_t)(uintptr_t)(bufs_mem + (size_t)i * buf_size);
		vr.desc[i].len = buf_size;
		vr.desc[i].flags = VRING_DESC_F_WRITE;
		vr.desc[i].next = 0;
	}

	mem = calloc(1, sizeof(*mem) + sizeof(mem->regions[0]));
	if (!mem)
		die("calloc");
	mem->nregions = 1;
	mem->regions[0].guest_phys_addr = (uint64_t)(uintptr_t)base;
	mem->regions[0].userspace_addr = (uint64_t)(uintptr_t)base;
	mem->regions[0].memory_size = total;
	if (ioctl(vhost_fd, VHOST_SET_MEM_TABLE, mem))
		die("VHOST_SET_MEM_TABLE");
	free(mem);

	st.index = 0;
	st.num = ring_num;
	if (ioctl(vhost_fd, VHOST_SET_VRING_NUM, &st))
		die("VHOST_SET_VRING_NUM");
	st.num = 0;
	if (ioctl(vhost_fd, VHOST_SET_VRING_BASE, &st))
		die("VHOST_SET_VRING_BASE");
	memset(&addr, 0, sizeof(addr));
	addr.index = 0;
	addr.desc_user_addr = (uint64_t)(uintptr_t)vr.desc;
	addr.avail_user_addr = (uint64_t)(uintptr_t)vr.avail;
	addr.used_user_addr = (uint64_t)(uintptr_t)vr.used;
	if (ioctl(vhost_fd, VHOST_SET_VRING_ADDR, &addr))
		die("VHOST_SET_VRING_ADDR");

	kick_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	call_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	if (kick_fd < 0 || call_fd < 0)
		die("eventfd");
	f.index = 0;
	f.fd = kick_fd;
	if (ioctl(vhost_fd, VHOST_SET_VRING_KICK, &f))
		die("VHOST_SET_VRING_KICK");
	f.fd = call_fd;
	if (ioctl(vhost_fd, VHOST_SET_VRING_CALL, &f))
		die("VHOST_SET_VRING_CALL");
	/* queue 1 (TX) stays without a backend: nothing is sent from the guest */
}

static int do_attach(void)
{
	int r = set_backend(tap_fd);

	if (r)
		return r;
	attached = 1;
	cnt.attaches++;
	if (posted)
		kick_if_needed();
	return 0;
}

static void usage(void)
{
	fprintf(stderr,
		"usage: vhostrx (--fd N | --dev NAME | --tap NAME) [--flags HEX] [--bp]\n"
		"               [--vnet-hdr] [--ring N] [--bufs N] [--buf-size B]\n"
		"               [--rate PPS | --delay-us N] [--burst N] [--paused]\n"
		"               [--detached] [--cpu C]\n");
	exit(2);
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "fd", required_argument, NULL, 'F' },
		{ "dev", required_argument, NULL, 'd' },
		{ "tap", required_argument, NULL, 'd' },
		{ "flags", required_argument, NULL, 'f' },
		{ "bp", no_argument, NULL, 'b' },
		{ "vnet-hdr", no_argument, NULL, 'v' },
		{ "ring", required_argument, NULL, 'r' },
		{ "bufs", required_argument, NULL, 'n' },
		{ "buf-size", required_argument, NULL, 's' },
		{ "rate", required_argument, NULL, 'R' },
		{ "delay-us", required_argument, NULL, 'D' },
		{ "burst", required_argument, NULL, 'B' },
		{ "paused", no_argument, NULL, 'P' },
		{ "detached", no_argument, NULL, 'X' },
		{ "cpu", required_argument, NULL, 'c' },
		{ NULL, 0, NULL, 0 },
	};
	int c, cpu = -1, bp = 0, want_vnet = 0, start_detached = 0;
	int i, vnet_sock;
	const char *dev = NULL;
	unsigned long flags = IFF_TAP | IFF_NO_PI;
	unsigned long rate = 0, delay_us = 0;
	uint64_t interval_ns = 0, credit_ns = 0, refill_ns = 0;
	unsigned long burst = 8;
	struct ifreq ifr;
	/* pending "wait" */
	char wait_key[32] = "";
	unsigned long long wait_n = 0;
	uint64_t wait_ms = 0, last_progress = 0;
	char line[256];
	size_t line_len = 0;

	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 'F': tap_fd = atoi(optarg); break;
		case 'd': dev = optarg; break;
		case 'f': flags = strtoul(optarg, NULL, 0); break;
		case 'b': bp = 1; break;
		case 'v': want_vnet = 1; break;
		case 'r': ring_num = (unsigned int)strtoul(optarg, NULL, 0); break;
		case 'n': nbufs = (unsigned int)strtoul(optarg, NULL, 0); break;
		case 's': buf_size = (unsigned int)strtoul(optarg, NULL, 0); break;
		case 'R': rate = strtoul(optarg, NULL, 0); break;
		case 'D': delay_us = strtoul(optarg, NULL, 0); break;
		case 'B': burst = strtoul(optarg, NULL, 0); break;
		case 'P': running = 0; break;
		case 'X': start_detached = 1; break;
		case 'c': cpu = atoi(optarg); break;
		default: usage();
		}
	}
	if ((tap_fd < 0) == !dev || optind != argc)
		usage();
	if (!ring_num || ring_num > 32768 || (ring_num & (ring_num - 1))) {
		fprintf(stderr, "vhostrx: --ring must be a power of 2 <= 32768\n");
		return 2;
	}
	if (!nbufs)
		nbufs = ring_num;
	if (nbufs > ring_num || buf_size < HDR_LEN + 64) {
		fprintf(stderr, "vhostrx: need --bufs <= --ring, --buf-size >= %zu\n",
			HDR_LEN + 64);
		return 2;
	}
	if ((rate && delay_us) || !burst)
		usage();
	if (rate)
		interval_ns = 1000000000ull / rate;
	else if (delay_us)
		interval_ns = delay_us * 1000ull;
	signal(SIGPIPE, SIG_IGN);

	if (cpu >= 0) {
		cpu_set_t set;

		CPU_ZERO(&set);
		CPU_SET(cpu, &set);
		if (sched_setaffinity(0, sizeof(set), &set))
			die("sched_setaffinity");
	}
	for (i = 0; i < MAX_IDS; i++) {
		seen[i] = calloc(MAX_SEQ / 8, 1);
		if (!seen[i])
			die("calloc");
		cnt.max_seq[i] = -1;
	}

	if (dev) {
		if (bp)
			flags |= IFF_BACKPRESSURE;
		if (want_vnet)
			flags |= IFF_VNET_HDR;
		tap_fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC);
		if (tap_fd < 0)
			die("/dev/net/tun");
		memset(&ifr, 0, sizeof(ifr));
		snprintf(ifr.ifr_name, IFNAMSIZ, "%s", dev);
		ifr.ifr_flags = (short)flags;
		if (ioctl(tap_fd, TUNSETIFF, &ifr))
			die("TUNSETIFF");
	}
	memset(&ifr, 0, sizeof(ifr));
	if (ioctl(tap_fd, TUNGETIFF, &ifr))
		die("TUNGETIFF");
	flags = (unsigned short)ifr.ifr_flags;
	is_tap = !!(flags & IFF_TAP);
	vnet_sock = !!(flags & IFF_VNET_HDR);
	if (want_vnet && !vnet_sock) {
		fprintf(stderr, "vhostrx: --vnet-hdr but the fd has no IFF_VNET_HDR\n");
		return 2;
	}
	if (vnet_sock) {
		int sz = (int)HDR_LEN;

		if (ioctl(tap_fd, TUNSETVNETHDRSZ, &sz))
			die("TUNSETVNETHDRSZ");
	}

	setup_vhost(vnet_sock);
	if (!start_detached) {
		int r = do_attach();

		if (r) {
			errno = -r;
			die("VHOST_NET_SET_BACKEND");
		}
	}
	if (running)
		post_all();

	printf("{\"event\":\"ready\",\"dev\":\"%s\",\"iff\":%lu,\"tap\":%s,"
	       "\"vnet_from\":\"%s\",\"hdr_len\":%zu,\"ring\":%u,\"bufs\":%u,"
	       "\"buf_size\":%u,\"interval_ns\":%llu,\"burst\":%lu,"
	       "\"running\":%s,\"attached\":%s}\n",
	       ifr.ifr_name, flags, is_tap ? "true" : "false",
	       vnet_sock ? "tap" : "vhost", HDR_LEN, ring_num, nbufs, buf_size,
	       (unsigned long long)interval_ns, burst, running ? "true" : "false",
	       attached ? "true" : "false");
	fflush(stdout);
	last_progress = now_ns() / 1000000ull;

	for (;;) {
		struct pollfd pfd[2];
		struct timespec ts, *tsp = NULL;
		int64_t timeout_ns = -1;
		uint64_t now = now_ns();
		nfds_t n = 0;
		int call_idx;

		if (running && used_pending()) {
			if (interval_ns)
				refill(&credit_ns, &refill_ns, interval_ns * burst, now);
			if (!interval_ns || credit_ns >= interval_ns)
				timeout_ns = 0;
			else
				timeout_ns = (int64_t)(interval_ns - credit_ns);
		}
		if (wait_key[0]) {
			uint64_t now_ms = now / 1000000ull;

			if (now_ms >= last_progress + wait_ms) {
				print_counters("wait", "stall");
				wait_key[0] = 0;
				continue;
			}
			if (timeout_ns < 0 ||
			    (uint64_t)timeout_ns > (last_progress + wait_ms - now_ms) * 1000000ull)
				timeout_ns = (int64_t)((last_progress + wait_ms - now_ms) *
						       1000000ull);
		}
		pfd[n].fd = 0;
		pfd[n].events = POLLIN;
		n++;
		call_idx = (int)n;
		pfd[n].fd = call_fd;
		pfd[n].events = POLLIN;
		n++;
		if (timeout_ns >= 0) {
			ts.tv_sec = timeout_ns / 1000000000;
			ts.tv_nsec = timeout_ns % 1000000000;
			tsp = &ts;
		}
		if (ppoll(pfd, n, tsp, NULL) < 0) {
			if (errno == EINTR)
				continue;
			die("ppoll");
		}
		if (pfd[call_idx].revents & POLLIN) {
			uint64_t v;

			if (read(call_fd, &v, sizeof(v)) == sizeof(v)) {
				cnt.calls++;
				cnt.signals += v;
			}
		}

		if (running) {
			int reaped = 0;

			while (reaped < REAP_BATCH && used_pending()) {
				if (interval_ns) {
					refill(&credit_ns, &refill_ns,
					       interval_ns * burst, now_ns());
					if (credit_ns < interval_ns)
						break;
					credit_ns -= interval_ns;
				}
				reap_one();
				reaped++;
				last_progress = now_ns() / 1000000ull;
				if (wait_key[0] && counter(wait_key) >= wait_n) {
					print_counters("wait", "ok");
					wait_key[0] = 0;
				}
			}
			if (reaped)
				publish_avail();
		}

		if ((pfd[0].revents & (POLLIN | POLLHUP | POLLERR))) {
			ssize_t r = read(0, line + line_len, sizeof(line) - 1 - line_len);
			char *nl;

			if (r <= 0)
				break;	/* EOF: the test is done with us */
			line_len += (size_t)r;
			line[line_len] = 0;
			while ((nl = strchr(line, '\n'))) {
				char cmd[32] = "", key[32] = "";
				unsigned long long a = 0, b = 0;

				*nl = 0;
				sscanf(line, "%31s %31s %llu %llu", cmd, key, &a, &b);
				if (!strcmp(cmd, "go")) {
					int err = 0;

					if (!attached && !cnt.attaches)
						err = do_attach();
					running = 1;
					if (!posted)
						post_all();
					/* no catching up after a pause */
					credit_ns = 0;
					refill_ns = now_ns();
					last_progress = now_ns() / 1000000ull;
					if (err) {
						cnt.errors++;
						print_error("go", -err);
					} else {
						print_counters("go", NULL);
					}
				} else if (!strcmp(cmd, "pause")) {
					running = 0;
					print_counters("pause", NULL);
				} else if (!strcmp(cmd, "stat")) {
					print_counters("stat", NULL);
				} else if (!strcmp(cmd, "wait")) {
					if (counter(key) >= a) {
						print_counters("wait", "ok");
					} else {
						snprintf(wait_key, sizeof(wait_key), "%s", key);
						wait_n = a;
						wait_ms = b;
						last_progress = now_ns() / 1000000ull;
					}
				} else if (!strcmp(cmd, "detach")) {
					int err = set_backend(-1);

					if (err) {
						cnt.errors++;
						print_error("detach", -err);
					} else {
						attached = 0;
						cnt.detaches++;
						print_counters("detach", NULL);
					}
				} else if (!strcmp(cmd, "attach")) {
					int err = do_attach();

					if (err) {
						cnt.errors++;
						print_error("attach", -err);
					} else {
						print_counters("attach", NULL);
					}
				} else if (!strcmp(cmd, "quit")) {
					print_counters("quit", NULL);
					return 0;
				} else if (cmd[0]) {
					printf("{\"event\":\"error\",\"unknown\":\"%s\"}\n", cmd);
					fflush(stdout);
				}
				line_len -= (size_t)(nl + 1 - line);
				memmove(line, nl + 1, line_len);
				line[line_len] = 0;
			}
			if (line_len >= sizeof(line) - 1)
				line_len = 0;	/* overlong garbage */
		}
	}
	print_counters("quit", NULL);
	return 0;
}
