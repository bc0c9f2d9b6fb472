;;;; slow-readers.lisp -- clients that read slowly or never: their answers
;;;; wait with their connections in epoll, not in workers (issue 18).
;;;;
;;;; The clients are raw sockets whose receive buffer is made small before
;;;; they connect, so the server's socket fills after a few KiB.  Each test
;;;; checks what a client sees, byte by byte with the strict reader
;;;; (tests/strict-reader.lisp), and what the server holds meanwhile (GALLOP:STATS:
;;;; :WRITING connections parked until their client reads, pool threads).
;;;; Timing is never asserted: the waits are bounded only so that a broken
;;;; server fails instead of hanging.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the memory account
;;;; (account.lisp: ACCOUNT-USED, OVERLOAD-LEVEL): that unsent output is
;;;; charged to it and given back.

(in-package #:gallop-tests)

(def-suite slow-readers :in gallop
  :description "Slow readers: unsent answers wait in epoll, pipelining waits for them.")
(in-suite slow-readers)

;;; Clients

(defun slow-reader (port &key (receive-buffer 4096))
  "A socket connected to 127.0.0.1:PORT whose receive buffer is
RECEIVE-BUFFER octets (set before connecting, so its TCP window stays that
small).  The test reads it only when it chooses to (SLOW-READER-STREAM)."
  (let ((socket (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp)))
    (handler-bind ((error (lambda (e) (declare (ignore e)) (sb-bsd-sockets:socket-close socket))))
      (setf (sb-bsd-sockets:sockopt-receive-buffer socket) receive-buffer)
      (sb-bsd-sockets:socket-connect socket #(127 0 0 1) port))
    socket))

(defun slow-reader-send (socket string)
  (let ((octets (octets string)))
    (sb-bsd-sockets:socket-send socket (coerce octets '(simple-array (unsigned-byte 8) (*))) nil)))

(defun slow-reader-stream (socket)
  "A binary input stream over SOCKET (reads time out after 20 s)."
  (sb-bsd-sockets:socket-make-stream socket :input t :output nil
                                            :element-type '(unsigned-byte 8)
                                            :buffering :full :timeout 20))

(defun close-slow-readers (sockets)
  (dolist (s sockets) (ignore-errors (sb-bsd-sockets:socket-close s))))

(defmacro with-slow-readers ((var) &body body)
  "Bind VAR to a list the body pushes slow readers onto; close them all after."
  `(let ((,var '()))
     (unwind-protect (progn ,@body)
       (close-slow-readers ,var))))

(defun get-line (path &key close)
  (crlf (format nil "GET ~A HTTP/1.1" path) "Host: t" (if close "Connection: close" "X-Pipelined: yes")))

(defun pattern-octets (size seed)
  "SIZE octets of a pattern that SEED shifts: a misplaced or lost range shows."
  (let ((v (make-array size :element-type '(unsigned-byte 8))))
    (dotimes (i size v)
      (setf (aref v i) (mod (+ (* i 7) seed (floor i 251)) 256)))))

(defun open-slow-readers (server port count requests)
  "Open COUNT slow readers to PORT, each sending REQUESTS and reading
nothing, 20 at a time: each group is parked (GALLOP:STATS :WRITING) before
the next connects, so the pool sees no burst (its growth under bursts is the
CPU heuristic's, not the write path's).  Returns the sockets, and whether
every group parked."
  (let ((sockets '()) (parked t))
    (loop for group from 0 below count by 20
          do (loop for i from group below (min count (+ group 20))
                   do (let ((socket (slow-reader port)))
                        (push socket sockets)
                        (slow-reader-send socket requests)))
             (unless (wait-until (lambda () (>= (stat server :writing) (min count (+ group 20))))
                                 :timeout 30)
               (setf parked nil)
               (return)))
    (values sockets parked)))

;;; The native app the tests serve: every body shape the write queue keeps in
;;; its own way (the output buffer handed over, a body kept by reference, a
;;; file through a duplicate fd, a streaming writer's copies, an answer from
;;; another thread).

(defparameter *slow-big* (pattern-octets (* 4 1024 1024) 1)
  "The 4 MiB body of /big: one vector every answer shares, so a thousand
answers waiting for their clients cost no memory of their own.  More than
the kernel keeps for a socket itself (on loopback a send buffer grows to
about 2.5 MiB: 2 x 10 segments of 64 KiB, and their overhead).")

(defvar *slow-file* nil)

(defun slow-file ()
  "A 1 MiB file in RUN-DIRECTORY for the sendfile answers."
  (or (and *slow-file* (probe-file *slow-file*) *slow-file*)
      (let ((path (merge-pathnames "slow.bin" (run-directory))))
        (with-open-file (out path :direction :output :element-type '(unsigned-byte 8)
                                  :if-exists :supersede)
          (write-sequence (pattern-octets (* 1024 1024) 3) out))
        (setf *slow-file* path))))

(defparameter *slow-text* (coerce (loop for i below (* 300 1024)
                                        collect (code-char (+ 32 (mod (* i 13) 95))))
                                  'simple-base-string)
  "A 300 KiB ASCII body, written through the output buffer.")

(defun slow-app (env)
  (let ((path (getf env :path-info)))
    (cond ((string= path "/yo") '(200 (:content-type "text/plain") ("Yo!")))
          ((string= path "/big") `(200 (:content-type "application/octet-stream") ,*slow-big*))
          ((string= path "/mid") `(200 (:content-type "application/octet-stream")
                                       ,(pattern-octets (* 200 1024) 2)))
          ((string= path "/text") `(200 (:content-type "text/plain") (,*slow-text*)))
          ((string= path "/file") `(200 (:content-type "application/octet-stream") ,(slow-file)))
          ((string= path "/stream")
           ;; A streaming writer in the worker: 20 chunks of 20 KiB.
           (lambda (respond)
             (let ((write (funcall respond '(200 (:content-type "application/octet-stream")))))
               (dotimes (i 20)
                 (funcall write (pattern-octets (* 20 1024) (+ 10 i))))
               (funcall write nil :close t))))
          ((string= path "/later")
           ;; Answered from another thread.
           (lambda (respond)
             (sb-thread:make-thread
              (lambda ()
                (funcall respond `(200 (:content-type "application/octet-stream")
                                       ,(pattern-octets (* 200 1024) 4))))
              :name "slow-readers answer")))
          (t '(404 (:content-type "text/plain") ("none"))))))

(defun stream-expected ()
  (apply #'concatenate '(vector (unsigned-byte 8))
         (loop for i below 20 collect (pattern-octets (* 20 1024) (+ 10 i)))))

(defun expect-answer (source body &key (status 200) (framing :content-length))
  "Read one answer from SOURCE strictly and check its status, framing and body."
  (let ((response (read-wire-message source :persistent t)))
    (is (= status (wire-status response)))
    (is (eq framing (wire-framing response)))
    (is (equalp (coerce body '(vector (unsigned-byte 8))) (wire-body response))
        "the body differs (~D octets, ~D expected)" (length (wire-body response)) (length body))
    response))

;;; Every shape, in order, to a client that reads only later

(test native-queued-answers-exact
  "A client pipelines every body shape, then reads nothing for a while: the
answers wait in the write queue, then arrive whole and in order."
  (with-app (server #'slow-app)
    (with-slow-readers (readers)
      (let ((socket (slow-reader (native-port server))))
        (push socket readers)
        (slow-reader-send socket (concatenate 'string
                                              (get-line "/yo") (get-line "/big") (get-line "/text")
                                              (get-line "/file") (get-line "/stream")
                                              (get-line "/later") (get-line "/yo")))
        ;; The server now holds an answer its client does not read, parked.
        (is-true (wait-until (lambda () (plusp (stat server :writing))) :timeout 20))
        (is (plusp (stat server :unsent-bytes)))
        (let ((source (stream-source (slow-reader-stream socket))))
          (expect-answer source (octets "Yo!"))
          (expect-answer source *slow-big*)
          (expect-answer source (octets *slow-text*))
          (expect-answer source (pattern-octets (* 1024 1024) 3))
          (let ((r (expect-answer source (stream-expected) :framing :chunked)))
            (is (not (wire-flag-p r :chunk-extensions))))
          (expect-answer source (pattern-octets (* 200 1024) 4))
          (expect-answer source (octets "Yo!")))
        ;; Nothing left behind once the client read it all.
        (is-true (wait-until (lambda () (and (zerop (stat server :writing))
                                             (zerop (stat server :unsent-bytes))
                                             (zerop (stat server :in-flight))))))))))

;;; No worker waits on a client

(defun check-slow-readers-hold-no-worker (server port big-path fresh-path fresh-body)
  "200 slow readers pipeline three requests for BIG-PATH (an answer larger
than the kernel buffers) to SERVER on PORT and never read: check that every
connection parks with its first answer unsent, that no worker holds any,
that only the first request of each was read, that a fresh client gets
exactly FRESH-BODY for FRESH-PATH, and that closing the readers frees all."
  ;; Each connection's reference to the one shared 4 MiB body counts in the
  ;; memory account, which cannot know the app shares it: 200 are 800 MiB,
  ;; past what the default limit (half the heap) lets clients hold, and the
  ;; overload manager would close the largest holders.  This is about
  ;; workers, not memory: the limit is the whole heap here.
  (with-memory-limit ((sb-ext:dynamic-space-size))
    (let ((clients 200))
      (with-slow-readers (readers)
        (multiple-value-bind (sockets parked)
            (open-slow-readers server port clients
                               (concatenate 'string (get-line big-path) (get-line big-path)
                                            (get-line big-path)))
          (setf readers sockets)
          (is-true parked "~D of ~D connections parked with their answers unsent"
                   (stat server :writing) clients))
        ;; No worker holds a connection: every one waits in epoll.
        (is-true (wait-until (lambda () (zerop (stat server :active))))
                 "~D connections held by workers" (stat server :active))
        ;; One answer each: the pipelined requests wait until it is read.
        (is (= clients (stat server :requests)))
        (let ((fresh (connect port)))
          (unwind-protect
               (progn
                 (send fresh (get-line fresh-path :close t))
                 (let ((r (read-wire fresh :close t)))
                   (is (= 200 (wire-status r)))
                   (is (string= (format nil "~D" (length fresh-body)) (wire-header r "Content-Length")))
                   (is (equalp (octets fresh-body) (wire-body r)))))
            (usocket:socket-close fresh)))
        (close-slow-readers readers)
        (setf readers '())
        ;; Their connections are closed, their queues freed.
        (is-true (wait-until (lambda () (and (zerop (stat server :open))
                                             (zerop (stat server :unsent-bytes))))
                             :timeout 30)
                 "~D connections still open" (stat server :open))))))
(test native-slow-readers-hold-no-worker
  "200 clients each pipeline three requests for a 4 MiB answer and never
read, against a pool of at most 8 workers: every connection parks with its
first answer unsent and no worker holds any of them, the second request of
each is not read (backpressure), and a fresh client is answered.  (With
workers waiting on their clients, 8 of them would hold 8 slow readers and
the fresh client would wait for the write timeout.)"
  (with-app (server #'slow-app :standby-thread-count 4 :max-thread-count 8)
    (check-slow-readers-hold-no-worker server (native-port server) "/big" "/yo" "Yo!")))

(test native-write-timeout
  "A client that reads nothing of its answer for the write timeout is closed
and counted; the server goes on serving."
  (with-app (server #'slow-app :write-timeout 1)
    (with-slow-readers (readers)
      (let ((socket (slow-reader (native-port server))))
        (push socket readers)
        (slow-reader-send socket (get-line "/big"))
        (is-true (wait-until (lambda () (plusp (stat server :write-timeouts))) :timeout 20))
        (is-true (wait-until (lambda () (zerop (stat server :open))) :timeout 10))
        (is (= 1 (stat server :write-timeouts)))
        (let ((fresh (connect (native-port server))))
          (unwind-protect
               (progn (send fresh (get-line "/yo" :close t))
                      (is (string= "Yo!" (wire-body-string (read-wire fresh :close t)))))
            (usocket:socket-close fresh)))))))

;;; A streaming answer from another thread to a client that does not read

(test native-suspended-writer-does-not-wait
  "A thread streams 100 chunks of 50 KiB to a client that reads nothing: the
writer returns at once (the octets wait with the connection, within
:MAX-UNSENT-BYTES), the connection waits in epoll, and when the client reads
it gets the whole body, then a second answer on the same connection."
  (let ((written (sb-thread:make-semaphore :name "chunks written"))
        (chunks (loop for i below 100 collect (pattern-octets (* 50 1024) (+ 40 i)))))
    (flet ((app (env)
             (if (string= (getf env :path-info) "/yo")
                 '(200 (:content-type "text/plain") ("Yo!"))
                 (lambda (respond)
                   (sb-thread:make-thread
                    (lambda ()
                      (let ((write (funcall respond '(200 (:content-type "application/octet-stream")))))
                        (dolist (chunk chunks) (funcall write chunk))
                        (sb-thread:signal-semaphore written)
                        (funcall write nil :close t)))
                    :name "slow-readers streamer")))))
      ;; The kernel takes up to about 2.5 MiB itself (see *SLOW-BIG*); the
      ;; queue holds the rest.
      (with-app (server #'app :max-unsent-bytes (* 8 1024 1024))
        (with-slow-readers (readers)
          (let ((socket (slow-reader (native-port server))))
            (push socket readers)
            (slow-reader-send socket (concatenate 'string (get-line "/events") (get-line "/yo")))
            (is-true (sb-thread:wait-on-semaphore written :timeout 20)
                     "the writer waited for the client")
            (is-true (wait-until (lambda () (plusp (stat server :writing))) :timeout 20))
            (let* ((source (stream-source (slow-reader-stream socket)))
                   (r (expect-answer source (apply #'concatenate '(vector (unsigned-byte 8)) chunks)
                                     :framing :chunked)))
              (is (equal (make-list 100 :initial-element (* 50 1024)) (wire-chunk-sizes r)))
              (expect-answer source (octets "Yo!")))
            (is-true (wait-until (lambda () (zerop (stat server :in-flight)))))))))))

;;; Pipelining: how far answers run ahead of the reader, and turns

(defun answers-match-p (source count body)
  "Read COUNT answers from SOURCE strictly: true when each is 200 with a
Content-Length and exactly BODY."
  (let ((body (coerce body '(vector (unsigned-byte 8)))))
    (loop repeat count
          always (let ((r (read-wire-message source :persistent t)))
                   (and (= 200 (wire-status r)) (eq :content-length (wire-framing r))
                        (equalp body (wire-body r)))))))

(defun check-few-answers-ahead (server port path body)
  "A client with a 4 KiB receive buffer pipelines 1,000 requests for PATH (a
short answer, BODY) in one go and reads nothing.  The server must stop
reading them soon: once the kernel holds +KERNEL-UNSENT-BYTES+ of answers not
yet sent, the rest wait with the connection, and no further request is read.
\(Without that bound Linux grows the socket's send buffer to megabytes and all
1,000 are answered at once; with a thousand such clients that is millions of
answers nobody reads.)  Then the client reads all 1,000, exactly."
  (let ((count 1000))
    (with-slow-readers (readers)
      (let ((socket (slow-reader port)))
        (push socket readers)
        (slow-reader-send socket (apply #'concatenate 'string
                                        (loop repeat count collect (get-line path))))
        ;; Parked until the client reads: no request is read from here on.
        (is-true (wait-until (lambda () (and (= 1 (stat server :writing))
                                             (zerop (stat server :active))))
                             :timeout 20))
        (let ((answered (stat server :requests)))
          (is (< answered 500)
              "~D of ~D pipelined requests answered before the server stopped reading"
              answered count))
        (is-true (answers-match-p (stream-source (slow-reader-stream socket)) count (octets body))
                 "the ~D answers did not arrive exactly" count)
        (is-true (wait-until (lambda () (and (zerop (stat server :writing))
                                             (= count (stat server :requests))))))))))

(test native-few-answers-ahead-of-the-reader
  "GALLOP:START: a client that pipelines 1,000 requests and reads nothing gets
only a few hundred answered before the server waits for it to read."
  (with-app (server #'slow-app)
    (check-few-answers-ahead server (native-port server) "/yo" "Yo!")))

(defun turns-app (log lock &optional gate)
  "An app that notes each request's path in LOG (a list in a cons) and
answers with it; /a/... sleeps 20 ms first, and /a/0 first waits for the
semaphore GATE (at most 10 s) if given."
  (lambda (env)
    (let ((path (getf env :path-info)))
      (sb-thread:with-mutex (lock) (push path (car log)))
      (when (and gate (string= path "/a/0"))
        (sb-thread:wait-on-semaphore gate :timeout 10))
      (when (uiop:string-prefix-p "/a/" path) (sleep 0.02))
      `(200 (:content-type "text/plain") (,path)))))

(test native-pipelined-requests-take-turns
  "With one worker, client A pipelines 20 slow requests in one packet; client
B sends one while A's first runs (held at a gate until B's request is in).
B is served after a few of A's, not after all 20: each connection serves
one buffered request per turn, then queues behind the others (as nginx
does).  A still gets all 20 answers, in order."
  (let* ((log (list '())) (lock (sb-thread:make-mutex)) (gate (sb-thread:make-semaphore)))
    (with-app (server (turns-app log lock gate) :standby-thread-count 1 :max-thread-count 1)
      (with-slow-readers (readers)
        (let ((a (slow-reader (native-port server) :receive-buffer 65536))
              (paths (loop for i below 20 collect (format nil "/a/~D" i))))
          (push a readers)
          (slow-reader-send a (apply #'concatenate 'string (mapcar #'get-line paths)))
          (is-true (wait-until (lambda () (sb-thread:with-mutex (lock) (car log)))))
          (let ((b (connect (native-port server))))
            (unwind-protect
                 (progn (send b (get-line "/b" :close t))
                        ;; B's connection accepted (its request is in the
                        ;; kernel's buffer since the send): let A's first go.
                        (is-true (wait-until (lambda () (= 2 (getf (gallop:stats server) :open)))))
                        (sb-thread:signal-semaphore gate)
                        (let ((r (read-wire b :close t)))
                          (is (= 200 (wire-status r)))
                          (is (string= "2" (wire-header r "Content-Length")))
                          (is (string= "/b" (wire-body-string r)))))
              (usocket:socket-close b)))
          (let ((order (sb-thread:with-mutex (lock) (reverse (car log)))))
            (is (<= (position "/b" order :test #'string=) 5)
                "B was served after ~D of A's pipelined requests" (position "/b" order :test #'string=)))
          (let ((source (stream-source (slow-reader-stream a))))
            (is-true (loop for path in paths
                           always (let ((r (read-wire-message source :persistent t)))
                                    (and (= 200 (wire-status r))
                                         (equalp (octets path) (wire-body r)))))
                     "A's answers did not arrive exactly and in order"))
          ;; Each request was served once, A's in order.
          (is (equal paths (remove "/b" (sb-thread:with-mutex (lock) (reverse (car log)))
                                   :test #'string=))))))))

(test native-next-request-after-a-late-answer-runs-in-a-worker
  "A request answered from another thread (a timer, a broadcaster) is
followed by a pipelined one: that one runs in a worker of the pool, not in
the answering thread, which must not be kept by other requests' handlers."
  (flet ((app (env)
           (if (string= "/later" (getf env :path-info))
               (lambda (respond)
                 (sb-thread:make-thread
                  (lambda () (sleep 0.05)
                    (funcall respond '(200 (:content-type "text/plain") ("later"))))
                  :name "late answerer (test)"))
               `(200 (:content-type "text/plain")
                     (,(sb-thread:thread-name sb-thread:*current-thread*))))))
    (with-app (server #'app)
      (let ((s (connect (native-port server))))
        (unwind-protect
             (progn
               (send s (concatenate 'string (get-line "/later") (get-line "/who" :close t)))
               (let ((source (stream-source (usocket:socket-stream s))))
                 (expect-answer source (octets "later"))
                 (let ((r (read-wire-message source)))
                   (is (= 200 (wire-status r)))
                   (is (search "-worker" (wire-body-string r))
                       "the next request ran in ~S" (wire-body-string r)))))
          (usocket:socket-close s))))))

;;; The drop-in acceptor

(defparameter *slow-mid-string*
  (coerce (loop for i below (* 32 1024) collect (code-char (+ 32 (mod (* i 11) 95))))
          'simple-base-string)
  "A 32 KiB answer: within the default :MAX-UNSENT-BYTES.")

(hunchentoot:define-easy-handler (handle-slow-mid :uri "/slow/mid") ()
  (setf (hunchentoot:content-type*) "text/plain")
  *slow-mid-string*)

(hunchentoot:define-easy-handler (handle-slow-yo :uri "/slow/yo") ()
  (setf (hunchentoot:content-type*) "text/plain")
  "Yo!")

(hunchentoot:define-easy-handler (handle-slow-big :uri "/slow/big") ()
  ;; A body returned: it waits by reference, whatever its size.
  (setf (hunchentoot:content-type*) "application/octet-stream")
  *slow-big*)

(hunchentoot:define-easy-handler (handle-slow-file :uri "/slow/file") ()
  (hunchentoot:handle-static-file (slow-file) "application/octet-stream"))

(hunchentoot:define-easy-handler (handle-slow-stream :uri "/slow/stream") ()
  ;; Streams 1 MiB through SEND-HEADERS in 8 KiB writes: past
  ;; :MAX-UNSENT-BYTES the handler waits for the client (by design).
  (setf (hunchentoot:content-type*) "application/octet-stream"
        (hunchentoot:content-length*) (* 1024 1024))
  (let ((out (hunchentoot:send-headers))
        (data (pattern-octets (* 1024 1024) 5)))
    (loop for start from 0 below (length data) by 8192
          do (write-sequence data out :start start :end (+ start 8192)))
    (finish-output out))
  nil)

(test easy-acceptor-queued-answers-exact
  "Through Hunchentoot: answers a client does not read yet wait in the queue
\(a returned octet body, a handler streaming past the bound, a string body, a
static file) and arrive whole and in order."
  (with-server (server 'gallop:easy-acceptor)
    (with-slow-readers (readers)
      (let ((socket (slow-reader (port-of server))))
        (push socket readers)
        (slow-reader-send socket (concatenate 'string (get-line "/slow/big") (get-line "/slow/stream")
                                              (get-line "/slow/mid") (get-line "/slow/file")
                                              (get-line "/slow/mid")))
        (is-true (wait-until (lambda () (plusp (stat server :writing))) :timeout 20))
        (is (= 1 (stat server :requests)) "pipelined requests were read before the answer was")
        (let ((source (stream-source (slow-reader-stream socket))))
          (expect-answer source *slow-big*)
          (expect-answer source (pattern-octets (* 1024 1024) 5))
          (expect-answer source (octets *slow-mid-string*))
          (expect-answer source (pattern-octets (* 1024 1024) 3))
          (expect-answer source (octets *slow-mid-string*)))
        (is-true (wait-until (lambda () (and (zerop (stat server :writing))
                                             (zerop (stat server :unsent-bytes))))))))))

(test easy-acceptor-slow-readers-hold-no-worker
  "200 clients each pipeline three requests for a 4 MiB answer the handler
returns and never read, against a pool of at most 8 workers: each
connection parks with its first answer unsent and no worker holds any of
them, and a fresh client is answered."
  (with-server (server 'gallop:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster :standby-thread-count 4
                                                                     :max-thread-count 8))
    (check-slow-readers-hold-no-worker server (port-of server) "/slow/big" "/slow/mid"
                                       *slow-mid-string*)))

(test easy-acceptor-few-answers-ahead-of-the-reader
  "GALLOP:EASY-ACCEPTOR: a client that pipelines 1,000 requests and reads
nothing gets only a few hundred answered before the server waits for it."
  (with-server (server 'gallop:easy-acceptor)
    (check-few-answers-ahead server (port-of server) "/slow/yo" "Yo!")))

(test stock-acceptor-few-answers-ahead-of-the-reader
  "A stock HUNCHENTOOT:EASY-ACCEPTOR with GALLOP:TASKMASTER (Hunchentoot
accepts, the engine adopts each socket): the same bound."
  (with-server (server 'hunchentoot:easy-acceptor :taskmaster (make-instance 'gallop:taskmaster))
    (check-few-answers-ahead server (port-of server) "/slow/yo" "Yo!")))

;;; Streaming writers: past MAX-UNSENT-BYTES what they write is charged to
;;; the memory account and waits with the connection, not in the writer
;;; (http/output-queue.lisp).  Only when the account refuses does a writer
;;; wait for its client, and only MAX-WAITING-WRITERS of them at once.

(defun streamed-pieces (seed)
  "About 4 MiB in 96 pieces: 64 KiB ones, which a connection copies when it
queues them, between 2 KiB ones, which fill its output buffer and are
queued with it.  Far past the kernel's buffers and :MAX-UNSENT-BYTES."
  (loop for i below 96
        collect (pattern-octets (if (evenp i) (* 64 1024) 2048) (+ seed i))))

(defun joined-octets (pieces)
  (apply #'concatenate '(vector (unsigned-byte 8)) pieces))

(defun piece-streaming-app (pieces finished &key (every-write t))
  "A native app whose handler streams PIECES from its worker, then pushes
onto the list in the cons FINISHED whether every write found the client
there (EVERY-WRITE NIL: it stops at the first that did not).  /yo answers
Yo!."
  (lambda (env)
    (if (string= (getf env :path-info) "/yo")
        '(200 (:content-type "text/plain") ("Yo!"))
        (lambda (respond)
          (let ((write (funcall respond '(200 (:content-type "application/octet-stream"))))
                (all t))
            (dolist (piece pieces)
              (unless (funcall write piece)
                (setf all nil)
                (unless every-write (return))))
            (funcall write nil :close t)
            (sb-ext:atomic-push all (car finished)))))))

(defvar *streamed-pieces* (streamed-pieces 60)
  "What /slow/stream-pieces writes.")

(defvar *stream-finished* (list '())
  "The handler of /slow/stream-pieces pushes onto its car whether every
write succeeded, once it wrote them all.")

(hunchentoot:define-easy-handler (handle-slow-stream-pieces :uri "/slow/stream-pieces") ()
  ;; Streams *STREAMED-PIECES* through SEND-HEADERS, then says it finished.
  (setf (hunchentoot:content-type*) "application/octet-stream"
        (hunchentoot:content-length*) (reduce #'+ *streamed-pieces* :key #'length))
  (let ((out (hunchentoot:send-headers))
        (all t))
    (dolist (piece *streamed-pieces*)
      (unless (ignore-errors (write-sequence piece out) t)
        (setf all nil)
        (return)))
    (ignore-errors (finish-output out))
    (sb-ext:atomic-push all (car *stream-finished*)))
  nil)

(defun check-writer-does-not-wait (server port path body finished framing)
  "A client asks PATH on SERVER (at PORT), whose handler streams BODY and
then pushes onto the car of FINISHED, and reads nothing: the handler finishes
writing, every write taken, while the client has read nothing; the
connection then waits in epoll with no worker, holding the answer in the
account's :OUTPUT; the client reads the whole answer, exactly (FRAMING),
and the account is back to what it was."
  (let ((before (gallop.core::account-used :output)))
    (with-slow-readers (readers)
      (let ((socket (slow-reader port)))
        (push socket readers)
        (slow-reader-send socket (get-line path))
        (is-true (wait-until (lambda () (car finished)) :timeout 10)
                 "the handler did not finish before its client read")
        (is (equal '(t) (car finished)) "a write failed: ~S" (car finished))
        (is-true (wait-until (lambda () (and (= 1 (stat server :writing))
                                             (zerop (stat server :active))))
                             :timeout 10)
                 "the answer does not wait in epoll: ~S" (gallop:stats server))
        (is (< before (gallop.core::account-used :output)))
        (let ((source (stream-source (slow-reader-stream socket))))
          (expect-answer source body :framing framing)
          (close-slow-readers readers)
          (setf readers '()))))
    (is-true (wait-until (lambda () (and (zerop (stat server :open))
                                         (= before (gallop.core::account-used :output)))))
             ":OUTPUT is ~D, was ~D before" (gallop.core::account-used :output) before)))

(test native-streaming-writer-does-not-wait-for-its-reader
  "A native handler streams 4 MiB, in large and small pieces, from its
worker to a client that reads nothing: it finishes without waiting for the
client, the rest waits in epoll, counted in the account's :OUTPUT; then the
client reads all of it, exactly, and :OUTPUT is back where it was."
  (let* ((pieces (streamed-pieces 20))
         (finished (list '())))
    (with-app (server (piece-streaming-app pieces finished))
      (check-writer-does-not-wait server (native-port server) "/pieces" (joined-octets pieces)
                                  finished :chunked))))

(test easy-acceptor-streaming-writer-does-not-wait-for-its-reader
  "The same through Hunchentoot: a handler writing 4 MiB to the stream
SEND-HEADERS returns, to a client that reads nothing, finishes without
waiting for it; the client then reads all of it, exactly."
  (setf (car *stream-finished*) '())
  (with-server (server 'gallop:easy-acceptor)
    (check-writer-does-not-wait server (port-of server) "/slow/stream-pieces"
                                (joined-octets *streamed-pieces*) *stream-finished* :content-length)))

(test native-streaming-writer-stops-for-a-client-reading-nothing
  "A handler streaming on and on to a client that reads nothing is stopped
by the write timeout, as a parked answer would be: its writer answers NIL,
the connection closes, the timeout is counted, and the account's :OUTPUT is
back where it was."
  (let* ((piece (pattern-octets (* 64 1024) 9))
         (finished (list '()))
         (before (gallop.core::account-used :output)))
    (flet ((app (env)
             (declare (ignore env))
             (lambda (respond)
               (let ((write (funcall respond '(200 (:content-type "application/octet-stream")))))
                 ;; At most 64 MiB: the timeout must come long before.
                 (sb-ext:atomic-push (loop repeat 1024
                                           always (progn (sleep 0.005) (funcall write piece)))
                                     (car finished))))))
      (with-app (server #'app :write-timeout 1 :min-data-rate nil)
        (with-slow-readers (readers)
          (let ((socket (slow-reader (native-port server))))
            (push socket readers)
            (slow-reader-send socket (get-line "/on"))
            (is-true (wait-until (lambda () (car finished)) :timeout 20))
            (is (equal '(nil) (car finished)) "the writer was never stopped")
            (is (= 1 (stat server :write-timeouts)))
            (is-true (wait-until (lambda () (zerop (stat server :open)))))))))
    (is-true (wait-until (lambda () (= before (gallop.core::account-used :output))))
             ":OUTPUT is ~D, was ~D before" (gallop.core::account-used :output) before)))

(test native-writer-past-its-spill-limit-waits-for-its-reader
  "One connection holds at most a 64th of the account's limit of its
writer's output: past it the writer waits for its client, though the
account has room, and once the client reads it gets its whole answer,
exactly."
  (let* ((pieces (streamed-pieces 40))
         (finished (list '())))
    ;; A limit of 64 MiB: 1 MiB a connection, a quarter of the answer.
    (with-memory-limit ((* 64 1024 1024))
      (with-app (server (piece-streaming-app pieces finished) :min-data-rate nil)
        (with-slow-readers (readers)
          (let ((socket (slow-reader (native-port server))))
            (push socket readers)
            (slow-reader-send socket (get-line "/pieces"))
            (is-true (wait-until (lambda () (= 1 (stat server :waiting-writers))))
                     "the writer does not wait: ~S" (gallop:stats server))
            (is (<= (gallop.core::account-used :output) (* 1024 1024)))
            (is (null (car finished)))
            (expect-answer (stream-source (slow-reader-stream socket)) (joined-octets pieces)
                           :framing :chunked)
            (is-true (wait-until (lambda () (car finished))))
            (is (equal '(t) (car finished)))
            (is (zerop (stat server :writers-shed)))))))))

(defun read-until-closed (socket)
  "Read SOCKET until its end or a reset: the octets read."
  (let ((stream (slow-reader-stream socket))
        (buffer (make-array 65536 :element-type '(unsigned-byte 8)))
        (total 0))
    (handler-case (loop for n = (read-sequence buffer stream)
                        do (incf total n)
                        while (= n (length buffer)))
      (error () nil))
    total))

(defun check-waiting-writers-bound (server port path body framing)
  "SERVER (at PORT, with :MAX-WAITING-WRITERS 1, :MAX-UNSENT-BYTES 8 KiB and
no minimum rate) streams BODY for PATH, with the account full: client A
asks and reads nothing, and its writer waits for it (:WAITING-WRITERS 1);
client B asks and reads nothing, and its writer may not wait too: B's
connection is closed before the whole answer (:WRITERS-SHED 1).  Then the
account has room again and A reads the whole answer, exactly (FRAMING)."
  (let ((before (gallop.core::account-used :output)))
    (with-slow-readers (readers)
      (let ((a (slow-reader port))
            (b (slow-reader port)))
        (push a readers)
        (push b readers)
        (with-charged (100)
          (slow-reader-send a (get-line path))
          (is-true (wait-until (lambda () (= 1 (stat server :waiting-writers))))
                   "A's writer does not wait: ~S" (gallop:stats server))
          (slow-reader-send b (get-line path))
          (is-true (wait-until (lambda () (= 1 (stat server :writers-shed))))
                   "B's connection was not shed: ~S" (gallop:stats server))
          (is (= 1 (stat server :waiting-writers))))
        (is (< (read-until-closed b) (length body)) "B got its whole answer")
        (expect-answer (stream-source (slow-reader-stream a)) body :framing framing)
        (is (= 1 (stat server :writers-shed)))))
    (is-true (wait-until (lambda () (and (zerop (stat server :open))
                                         (zerop (stat server :waiting-writers))
                                         (= before (gallop.core::account-used :output)))))
             ":OUTPUT is ~D, was ~D before" (gallop.core::account-used :output) before)))

(test native-waiting-writers-are-bounded
  "With the memory account full, one writer waits for its client (the bound
is 1 here) and a second one's connection is closed instead; the first gets
its whole answer once its client reads."
  (let* ((pieces (streamed-pieces 30))
         (finished (list '())))
    (with-app (server (piece-streaming-app pieces finished :every-write nil)
                      :max-waiting-writers 1 :max-unsent-bytes 8192 :min-data-rate nil)
      (check-waiting-writers-bound server (native-port server) "/pieces" (joined-octets pieces)
                                   :chunked))))

(test easy-acceptor-waiting-writers-are-bounded
  "The same through Hunchentoot's SEND-HEADERS stream."
  (setf (car *stream-finished*) '())
  (with-server (server 'gallop:easy-acceptor
                       :taskmaster (make-instance 'gallop:taskmaster :max-waiting-writers 1
                                                                     :max-unsent-bytes 8192
                                                                     :min-data-rate nil))
    (check-waiting-writers-bound server (port-of server) "/slow/stream-pieces"
                                 (joined-octets *streamed-pieces*) :content-length)))

(test writers-past-their-own-share-all-wait-while-memory-is-plenty
  "Writers past their connection's share of the account (a 64th of its
limit) wait for their clients, however many, while memory is plentiful:
the bound on waiting writers is for a full account only.  Two clients read
nothing with :MAX-WAITING-WRITERS 1; neither is shed, and each then reads
its whole answer, exactly."
  (let* ((pieces (streamed-pieces 40))
         (finished (list '())))
    (with-memory-limit ((* 64 1024 1024))
      (with-app (server (piece-streaming-app pieces finished)
                        :min-data-rate nil :max-waiting-writers 1)
        (with-slow-readers (readers)
          (let ((a (slow-reader (native-port server)))
                (b (slow-reader (native-port server))))
            (push a readers)
            (push b readers)
            (slow-reader-send a (get-line "/pieces"))
            (slow-reader-send b (get-line "/pieces"))
            (is-true (wait-until (lambda () (= 2 (stat server :waiting-writers))))
                     "both writers do not wait: ~S" (gallop:stats server))
            (is (zerop (gallop.core::overload-level)))
            (dolist (socket (list a b))
              (expect-answer (stream-source (slow-reader-stream socket)) (joined-octets pieces)
                             :framing :chunked))
            (is (zerop (stat server :writers-shed)))))))))
