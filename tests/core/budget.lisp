;;;; budget.lisp -- the head budget: connections parked with part of a
;;;; request head hold their input buffers, and clients choose how many there
;;;; are; past the engine's HEAD-BUDGET a new one gets 503 (never a heap
;;;; exhaustion), and the budget comes back as heads complete.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: the buffer pool
;;;; (os/buffers.lisp: *BUFFER-POOL*, ACQUIRE-BUFFER, RELEASE-BUFFER, BUFFER-
;;;; POOL-DROPPED), to hold the budget's buffers by hand and see them given
;;;; back, which no client can observe.

(in-package #:gallop-tests)

(in-suite core)

(defun check-503-answer (socket)
  "Read the whole answer on SOCKET: a 503 with Retry-After, Content-Length
equal to its body, then the server's close."
  (let ((response (read-response socket)))
    (is (and response (= 503 (response-status response))))
    (when response
      (is (equal "1" (header response "Retry-After")))
      (is (equalp "close" (header response "Connection")))
      (is (equal "503 Service Unavailable
" (body-string response)))
      (is (= (length (response-body response)) (parse-integer (header response "Content-Length")))))
    (is (closed-by-peer-p socket))))

(test partial-heads-past-the-head-budget-get-503
  (let ((buffer 8192))                  ; the size of a connection's input buffer
    (with-engine (engine port :head-budget (* 5 buffer))
      (let ((sockets '())
            (partial (format nil "GET /partial HTTP/1.1~C~CHo" #\Return #\Linefeed)))
        (unwind-protect
             (progn
               (dotimes (i 5)
                 (let ((socket (connect port)))
                   (push socket sockets)
                   (send socket partial)
                   (is (wait-until (lambda () (= (* (1+ i) buffer) (engine-stat engine :head-bytes))))
                       "connection ~D parked with its buffer counted: ~S" i
                       (engine-stat engine :head-bytes))))
               ;; The budget is spent: a sixth partial head is not kept.
               (let ((socket (connect port)))
                 (unwind-protect
                      (progn (send socket partial)
                             (check-503-answer socket))
                   (usocket:socket-close socket)))
               (is (= 1 (engine-stat engine :shed)))
               (is (= (* 5 buffer) (engine-stat engine :head-bytes)))
               ;; The five complete their heads and are served; the budget comes back.
               (dolist (socket sockets)
                 (send socket (crlf "st: x"))
                 (let ((response (read-response socket)))
                   (is (and response (= 200 (response-status response))
                            (string= "GET /partial HTTP/1.1" (body-string response))))))
               (is (wait-until (lambda () (zerop (engine-stat engine :head-bytes)))))
               ;; and a new partial head is kept again
               (let ((socket (connect port)))
                 (push socket sockets)
                 (send socket partial)
                 (is (wait-until (lambda () (= buffer (engine-stat engine :head-bytes)))))))
          (mapc #'usocket:socket-close sockets))
        ;; closed connections give their share back too
        (is (wait-until (lambda () (zerop (engine-stat engine :head-bytes)))))))))

(test a-head-buffer-does-not-grow-past-the-head-budget
  ;; A 20 KB head needs the buffer grown past 8 KiB; with 12,000 octets of
  ;; budget it is not, and the answer is 503 (not 431: the head is under
  ;; MAX-HEAD-BYTES).  The same head is served with budget to spare.
  (let ((head (raw-lines "GET /long HTTP/1.1" "Host: x"
                         (format nil "X-Long: ~A" (make-string 20000 :initial-element #\a)))))
    (with-engine (engine port :head-budget 12000 :max-head-bytes 65536)
      (let ((socket (connect port)))
        (unwind-protect
             (progn (send socket head)
                    (check-503-answer socket))
          (usocket:socket-close socket))))
    (with-engine (engine port :max-head-bytes 65536)
      (let ((response (request port head)))
        (is (and response (= 200 (response-status response))
                 (string= "GET /long HTTP/1.1" (body-string response))))))))

(defun holding-handler (started release)
  "A handler answering like HELLO-HANDLER (200, the request line as body),
except that for a request line containing /hold it first signals the
semaphore STARTED and waits (up to 10 s) on RELEASE: the connection's buffer
stays with it meanwhile."
  (lambda (connection)
    (answer-request-lines connection
                          (lambda (first-line)
                            (when (search "/hold" first-line)
                              (sb-thread:signal-semaphore started)
                              (sb-thread:wait-on-semaphore release :timeout 10))))))

(test a-grown-head-buffer-counts-while-its-request-is-served
  ;; A 20 KB head grows its connection's buffer to 32 KiB.  That buffer is
  ;; counted against the budget as long as the connection holds it, not only
  ;; while it is parked: with 40,000 octets of budget, a second 20 KB head
  ;; arriving while the first request is still being served gets 503 (each
  ;; worker reading a long head used to grow its buffer beside the budget,
  ;; which with a raised head limit exhausted the heap).  Once the first
  ;; connection gives its buffer back, the same head is served again.
  (flet ((long-head (path)
           (raw-lines (format nil "GET ~A HTTP/1.1" path) "Host: x"
                      (format nil "X-Long: ~A" (make-string 20000 :initial-element #\a)))))
    (let* ((started (sb-thread:make-semaphore))
           (release (sb-thread:make-semaphore))
           (listener (make-instance 'sb-bsd-sockets:inet-socket :type :stream :protocol :tcp))
           (engine (gallop.core:make-engine :handler (holding-handler started release)
                                            :head-budget 40000 :max-head-bytes 65536
                                            :log-error (lambda (&rest args) (declare (ignore args))))))
      (setf (sb-bsd-sockets:sockopt-reuse-address listener) t)
      (sb-bsd-sockets:socket-bind listener #(127 0 0 1) 0)
      (sb-bsd-sockets:socket-listen listener 128)
      (gallop.core:engine-start engine :listen-fd (sb-bsd-sockets:socket-file-descriptor listener))
      (unwind-protect
           (let ((port (nth-value 1 (sb-bsd-sockets:socket-name listener)))
                 (held (list)))
             (unwind-protect
                  (let ((a (connect port)))
                    (push a held)
                    (send a (long-head "/hold"))
                    (is (sb-thread:wait-on-semaphore started :timeout 10))
                    (is (= 32768 (engine-stat engine :head-bytes)))
                    (let ((b (connect port)))
                      (unwind-protect
                           (progn (send b (long-head "/b"))
                                  (check-503-answer b))
                        (usocket:socket-close b)))
                    (sb-thread:signal-semaphore release)
                    (let ((response (read-response a)))
                      (is (and response (= 200 (response-status response))
                               (string= "GET /hold HTTP/1.1" (body-string response))
                               (= (length (response-body response))
                                  (parse-integer (header response "Content-Length"))))))
                    (is (wait-until (lambda () (zerop (engine-stat engine :head-bytes)))))
                    (let ((response (request port (long-head "/c"))))
                      (is (and response (= 200 (response-status response))
                               (string= "GET /c HTTP/1.1" (body-string response))))))
               (sb-thread:signal-semaphore release)
               (mapc #'usocket:socket-close held))
             (is (wait-until (lambda () (zerop (engine-stat engine :head-bytes))))))
        (gallop.core:engine-stop engine)
        (sb-bsd-sockets:socket-close listener)))))

(test dropped-grown-buffers-bring-a-full-collection
  ;; Grown head buffers live long enough to reach older generations, which
  ;; SBCL collects rarely: once a quarter of the heap's worth of them has
  ;; been left to the GC, the engine collects every generation (and the
  ;; count starts again).  An 8 KiB buffer goes back to the free list and is
  ;; not counted.
  (let ((pool gallop.core::*buffer-pool*)
        (grown (make-array 16384 :element-type '(unsigned-byte 8)))
        (pooled (gallop.core::acquire-buffer)))
    (setf (gallop.core::buffer-pool-dropped pool) 0)
    (gallop.core::release-buffer pooled)
    (is (= 0 (gallop.core::buffer-pool-dropped pool)))
    (gallop.core::release-buffer grown)
    (is (= 16384 (gallop.core::buffer-pool-dropped pool)))
    ;; Just short of a quarter of the heap: the next grown buffer crosses it.
    (setf (gallop.core::buffer-pool-dropped pool)
          (- (floor (sb-ext:dynamic-space-size) 4) 1000))
    (sb-ext:gc)                         ; so that no collection is due on its own
    (let ((epoch sb-kernel::*gc-epoch*))
      (gallop.core::release-buffer grown)
      (is (= 0 (gallop.core::buffer-pool-dropped pool)))
      (is (not (eq epoch sb-kernel::*gc-epoch*)) "no collection"))))
