// SPDX-License-Identifier: GPL-2.0
/*
 * vidstream - bursty video-like UDP: frames of N datagrams at F frames/s.
 *
 * sender:   vidstream --send --dst IP --port P [--fps F] [--frame-pkts N]
 *                     [--size BYTES] [--duration S] [--sndbuf B]
 *   Sends each frame as a back-to-back burst of N datagrams at the frame's
 *   start time (absolute schedule, no drift). Prints one JSON line at the
 *   end: frames, pkts, send_errors, late (frames started > 1 frame late).
 *
 * receiver: vidstream --recv --port P [--bind IP] [--max-frames M]
 *   Counts packets per frame until SIGTERM/SIGINT, then prints one JSON
 *   line: pkts, frames_seen (highest frame id + 1), complete (frames with
 *   all N packets), hist (number of frames by packets received, index
 *   0..N, over frames 0..frames_seen-1), and the completion latency of
 *   complete frames (first packet sent -> last packet received, same
 *   CLOCK_MONOTONIC: sender and receiver must run on the same machine)
 *   as lat_ms_p50/p99/max.
 *
 * Payload: "VID1", frame id (u32), packet index (u16), packets in frame
 * (u16), frame start time in ns (u64), padding.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAXPKTS 1024

struct hdr {
	char magic[4];
	uint32_t frame;
	uint16_t idx;
	uint16_t npkts;
	uint64_t t0;
} __attribute__((packed));

static volatile sig_atomic_t stop_req;

static void on_sig(int sig)
{
	(void)sig;
	stop_req = 1;
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

static void usage(void)
{
	fprintf(stderr,
		"usage: vidstream --send --dst IP --port P [--fps F] [--frame-pkts N]\n"
		"                 [--size B] [--duration S] [--sndbuf B]\n"
		"       vidstream --recv --port P [--bind IP] [--max-frames M]\n");
	exit(2);
}

static int do_send(const char *dst, int port, int fps, int npkts, int size,
		   double duration, int sndbuf)
{
	struct sockaddr_in sa = { .sin_family = AF_INET };
	unsigned long long frames = 0, pkts = 0, errs = 0, late = 0;
	uint64_t start, period, nframes;
	static unsigned char buf[65536];
	struct hdr *h = (struct hdr *)buf;
	int fd;

	sa.sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, dst, &sa.sin_addr) != 1) {
		fprintf(stderr, "vidstream: bad --dst\n");
		return 2;
	}
	fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa))) {
		perror("vidstream: socket/connect");
		return 1;
	}
	if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &sndbuf, sizeof(sndbuf)))
		setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
	memset(buf, 0, sizeof(buf));
	memcpy(h->magic, "VID1", 4);
	period = 1000000000ull / (uint64_t)fps;
	nframes = (uint64_t)(duration * fps);
	start = now_ns() + 10000000ull;
	while (frames < nframes && !stop_req) {
		uint64_t t = start + frames * period;
		struct timespec ts = { (time_t)(t / 1000000000ull), (long)(t % 1000000000ull) };
		int i;

		while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
			if (stop_req)
				break;
		if (now_ns() > t + period)
			late++;
		h->frame = (uint32_t)frames;
		h->npkts = (uint16_t)npkts;
		h->t0 = now_ns();
		for (i = 0; i < npkts; i++) {
			h->idx = (uint16_t)i;
			if (send(fd, buf, (size_t)size, 0) == size)
				pkts++;
			else
				errs++;
		}
		frames++;
	}
	printf("{\"frames\":%llu,\"pkts\":%llu,\"send_errors\":%llu,\"late\":%llu,"
	       "\"fps\":%d,\"frame_pkts\":%d,\"size\":%d}\n",
	       frames, pkts, errs, late, fps, npkts, size);
	return 0;
}

static int do_recv(const char *bindip, int port, unsigned int maxf)
{
	struct sockaddr_in sa = { .sin_family = AF_INET };
	unsigned short *count = calloc(maxf, sizeof(*count));
	uint64_t *lat = calloc(maxf, sizeof(*lat));
	unsigned long long pkts = 0, other = 0, nlat = 0, complete = 0;
	unsigned long long hist[MAXPKTS + 1];
	unsigned int frames_seen = 0, npkts = 0, f;
	static unsigned char buf[65536];
	int fd, rcvbuf = 16 << 20;

	if (!count || !lat)
		return 1;
	sa.sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, bindip, &sa.sin_addr) != 1) {
		fprintf(stderr, "vidstream: bad --bind\n");
		return 2;
	}
	fd = socket(AF_INET, SOCK_DGRAM, 0);
	if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa))) {
		perror("vidstream: socket/bind");
		return 1;
	}
	if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof(rcvbuf)))
		setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
	printf("{\"event\":\"ready\"}\n");
	fflush(stdout);
	while (!stop_req) {
		struct pollfd p = { .fd = fd, .events = POLLIN };
		struct hdr h;
		ssize_t r;

		if (poll(&p, 1, 200) <= 0)
			continue;
		r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
		if (r < 0)
			continue;
		if ((size_t)r < sizeof(h) || memcmp(buf, "VID1", 4)) {
			other++;
			continue;
		}
		memcpy(&h, buf, sizeof(h));
		pkts++;
		if (h.frame >= maxf || h.npkts == 0 || h.npkts > MAXPKTS)
			continue;
		npkts = h.npkts;
		if (h.frame + 1 > frames_seen)
			frames_seen = h.frame + 1;
		if (++count[h.frame] == h.npkts) {
			lat[nlat++] = now_ns() - h.t0;
			complete++;
		}
	}
	memset(hist, 0, sizeof(hist));
	for (f = 0; f < frames_seen; f++)
		hist[count[f] > MAXPKTS ? MAXPKTS : count[f]]++;
	qsort(lat, nlat, sizeof(*lat), cmp_u64);
	printf("{\"pkts\":%llu,\"other\":%llu,\"frames_seen\":%u,\"complete\":%llu,"
	       "\"frame_pkts\":%u,\"lat_ms_p50\":%.3f,\"lat_ms_p99\":%.3f,"
	       "\"lat_ms_max\":%.3f,\"hist\":[",
	       pkts, other, frames_seen, complete, npkts,
	       nlat ? lat[nlat / 2] / 1e6 : 0.0,
	       nlat ? lat[(nlat * 99) / 100 >= nlat ? nlat - 1 : (nlat * 99) / 100] / 1e6 : 0.0,
	       nlat ? lat[nlat - 1] / 1e6 : 0.0);
	for (f = 0; f <= npkts; f++)
		printf("%s%llu", f ? "," : "", hist[f]);
	printf("]}\n");
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
		{ "send", no_argument, NULL, 's' },
		{ "recv", no_argument, NULL, 'r' },
		{ "dst", required_argument, NULL, 'd' },
		{ "bind", required_argument, NULL, 'B' },
		{ "port", required_argument, NULL, 'p' },
		{ "fps", required_argument, NULL, 'f' },
		{ "frame-pkts", required_argument, NULL, 'n' },
		{ "size", required_argument, NULL, 'z' },
		{ "duration", required_argument, NULL, 't' },
		{ "sndbuf", required_argument, NULL, 'b' },
		{ "max-frames", required_argument, NULL, 'm' },
		{ NULL, 0, NULL, 0 },
	};
	const char *dst = NULL, *bindip = "0.0.0.0";
	int mode = 0, port = 0, fps = 30, npkts = 30, size = 1200, c;
	int sndbuf = 4 << 20;
	unsigned int maxf = 1000000;
	double duration = 5;
	struct sigaction sa;

	while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (c) {
		case 's': mode = 's'; break;
		case 'r': mode = 'r'; break;
		case 'd': dst = optarg; break;
		case 'B': bindip = optarg; break;
		case 'p': port = atoi(optarg); break;
		case 'f': fps = atoi(optarg); break;
		case 'n': npkts = atoi(optarg); break;
		case 'z': size = atoi(optarg); break;
		case 't': duration = atof(optarg); break;
		case 'b': sndbuf = atoi(optarg); break;
		case 'm': maxf = (unsigned int)strtoul(optarg, NULL, 0); break;
		default: usage();
		}
	}
	if (!port || fps <= 0 || npkts <= 0 || npkts > MAXPKTS ||
	    size < (int)sizeof(struct hdr) || size > 65000 || !maxf)
		usage();
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_sig;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	if (mode == 's') {
		if (!dst)
			usage();
		return do_send(dst, port, fps, npkts, size, duration, sndbuf);
	}
	if (mode == 'r')
		return do_recv(bindip, port, maxf);
	usage();
	return 2;
}
